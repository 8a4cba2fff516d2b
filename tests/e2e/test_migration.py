"""Streams that survive their worker, on a real mesh (launcher, gateway, preprocessor, router, 2 mocker workers as
separate processes, a 50 ms step so a stream lasts ~2 s): the worker serving a stream is SIGKILLed mid-stream and
the client's stream goes on from the other worker — for a text prompt, a ``prompt_embeds`` prompt and a chat
message of text and embeddings parts, the streamed text equals an undisturbed run's (the mocker's ids depend on the
prompt, so a duplicated, lost or restarted token shows), usage counts every token and the stream ends with
``[DONE]``; the preprocessor counts the migration. One real-model case (2 hf workers, SmolLM2, greedy) is in
``test_hf_stream_survives_its_worker``."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL, b64_of
from tests.support.fleet import wait_registered
from tests.support.load import child_pid, metric, stats
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

MAX_TOKENS = 40
SLOW_MOCKER = {"EMBEDMESH_WORKER_MOCKER_DECODE_MS": "50", "EMBEDMESH_WORKER_MOCKER_DECODE_MS_PER_SEQ": "0",
               "EMBEDMESH_WORKER_MOCKER_PREFILL_MS_PER_TOKEN": "0"}


def _rows(seed: int) -> str:
    import torch

    return b64_of(torch.randn(24, 576, generator=torch.Generator().manual_seed(seed)))


def _body(kind: str, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if kind == "text":
        return "/v1/completions", {**common, "prompt": "The capital of France is", "ignore_eos": True}
    if kind == "embeds":
        return "/v1/completions", {**common, "prompt_embeds": _rows(1), "ignore_eos": True}
    parts = [{"type": "text", "text": "Describe these rows:"}, {"type": "prompt_embeds", "data": _rows(2)},
             {"type": "text", "text": "in one line."}]
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": parts}]}


def _stream(mesh: Mesh, kind: str, model: str, max_tokens: int, kill_after: int | None = None
            ) -> tuple[str, dict[str, Any] | None, str | None, bool]:
    """(text, usage, finish reason, [DONE] seen); with ``kill_after``: SIGKILL the worker generating the stream
    once that many chunks with text arrived."""
    path, body = _body(kind, model, max_tokens)
    text: list[str] = []
    usage = finish = None
    done = False
    chunks = 0
    with httpx.stream("POST", f"{mesh.base_url}{path}", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                piece = c.get("text", c.get("delta", {}).get("content")) or ""
                text.append(piece)
                finish = c.get("finish_reason") or finish
                chunks += bool(piece)
            if kill_after is not None and chunks >= kill_after:
                _kill_generating(mesh)
                kill_after = None
    return "".join(text), usage, finish, done


def _kill_generating(mesh: Mesh) -> None:
    for i, w in enumerate(mesh.workers):
        try:
            busy = stats(w).active_requests > 0
        except Exception:  # noqa: BLE001 - killed earlier
            continue
        if busy:
            # The worker's whole process group (the launcher starts each child as its own session): it dies with
            # its engine's processes, as a container does; vLLM's engine core and workers would outlive a bare
            # SIGKILL of the worker, holding gigabytes for the rest of the run.
            os.killpg(child_pid(mesh, f"worker-{i}"), signal.SIGKILL)
            return
    raise AssertionError("no worker was generating the stream")


@pytest.fixture
def mocker_mesh() -> Iterator[Mesh]:
    mesh = start_mesh(workers=2, engine="mocker", env=SLOW_MOCKER,
                      extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    try:
        wait_registered(str(mesh.extra["router"]), 2)
        yield mesh
    finally:
        mesh.stop()


@pytest.mark.parametrize("kind", ["text", "embeds", "parts"])
def test_a_stream_survives_the_sigkill_of_its_worker(mocker_mesh: Mesh, kind: str) -> None:
    undisturbed, usage, finish, done = _stream(mocker_mesh, kind, "mocker", MAX_TOKENS)
    assert len(undisturbed.split()) == MAX_TOKENS and done and usage and usage["completion_tokens"] == MAX_TOKENS
    before = metric(mocker_mesh, "embedmesh_stream_migrations_total")
    t0 = time.monotonic()
    text, usage2, finish2, done2 = _stream(mocker_mesh, kind, "mocker", MAX_TOKENS, kill_after=8)
    assert text == undisturbed
    assert done2 and finish2 == finish and usage2 is not None
    assert usage2["completion_tokens"] == MAX_TOKENS and usage2["prompt_tokens"] == usage["prompt_tokens"]
    assert metric(mocker_mesh, "embedmesh_stream_migrations_total") == before + 1
    assert time.monotonic() - t0 < 60


def test_hf_stream_survives_its_worker() -> None:
    """The real model, greedy: the text after a SIGKILL mid-stream is the undisturbed text."""
    mesh = start_mesh(workers=2, engine="hf")
    try:
        wait_registered(str(mesh.extra["router"]), 2)
        undisturbed, _, _, _ = _stream(mesh, "text", MODEL, 24)
        text, usage, _, done = _stream(mesh, "text", MODEL, 24, kill_after=6)
        assert text == undisturbed and done and usage is not None and usage["completion_tokens"] == 24
    finally:
        mesh.stop()

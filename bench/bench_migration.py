"""Streams that survive their worker, measured: a mesh of 2 mocker workers (separate processes, a decode step of
``--decode-ms`` and a prefill of ``--prefill-ms`` per uncached position), and ``--kills`` times: a streamed request
run undisturbed, then the same request again with the worker generating it SIGKILLed after ``--kill-after`` text
chunks; a fresh mesh for every kill (the launcher stops a mesh once none of the workers it started is left). The
prompts cycle through a text prompt, a ``prompt_embeds`` prompt and a chat message of text and embeddings parts,
each run with its own random content (no prefix shared between runs), the workers' caches cleared between the
undisturbed and the disturbed run.

Per kill: whether the disturbed stream's text equals the undisturbed one's (and usage counts every token), the
added latency (the gap in the stream at the cut less the undisturbed run's median gap between chunks), and one
prefill of the same positions (prompt + the tokens sent before the cut) measured in the same run: a non-streamed
``prompt_embeds`` request of that many fresh random rows and ``max_tokens: 1``, through the same gateway.

Last line: ``migration: survived=N/K added_over_prefill_p50=X p90=Y max=Z`` (the issue's goal: K of K, and added
latency at most 1.2 times one prefill).

    python bench/bench_migration.py [--kills 20] [--kill-after 10] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.conftest import b64_of  # noqa: E402
from tests.support.fleet import wait_registered  # noqa: E402
from tests.support.load import child_pid, stats  # noqa: E402
from tests.support.mesh import Mesh, start_mesh  # noqa: E402

KINDS = ("text", "embeds", "parts")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _rows(n: int, seed: int) -> str:
    import torch

    return b64_of(torch.randn(n, 576, generator=torch.Generator().manual_seed(seed)))


def _body(kind: str, seed: int, max_tokens: int, prompt_len: int) -> tuple[str, dict[str, Any]]:
    import random

    rnd = random.Random(seed)
    common = {"model": "mocker", "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    words = " ".join(rnd.choice(WORDS) for _ in range(prompt_len))
    if kind == "text":
        return "/v1/completions", {**common, "prompt": words}
    if kind == "embeds":
        return "/v1/completions", {**common, "prompt_embeds": _rows(prompt_len, seed)}
    parts = [{"type": "text", "text": words[: len(words) // 2]},
             {"type": "prompt_embeds", "data": _rows(prompt_len // 2, seed)}]
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": parts}]}


class Run:
    def __init__(self) -> None:
        self.text = ""
        self.times: list[float] = []
        """When each chunk with text arrived."""
        self.usage: dict[str, int] = {}
        self.done = False
        self.error: dict[str, Any] | None = None
        self.kill_gap = 0.0
        self.sent_before_kill = 0


def _stream(mesh: Mesh, path: str, body: dict[str, Any], kill_after: int | None = None,
            on_kill: Any = None) -> Run:
    run = Run()
    pieces: list[str] = []
    killed_at: float | None = None
    with httpx.stream("POST", f"{mesh.base_url}{path}", json=body, timeout=300) as r:
        if r.status_code != 200:
            run.error = {"status": r.status_code, "body": r.read().decode()[:200]}
            return run
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                run.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                run.error = event["error"]
                continue
            run.usage = event.get("usage") or run.usage
            for c in event.get("choices", []):
                piece = c.get("text", c.get("delta", {}).get("content")) or ""
                if piece:
                    pieces.append(piece)
                    now = time.monotonic()
                    if killed_at is not None and not run.kill_gap:
                        run.kill_gap = now - run.times[-1]
                    run.times.append(now)
            if kill_after is not None and len(pieces) >= kill_after and killed_at is None:
                run.sent_before_kill = len(pieces)
                on_kill()
                killed_at = time.monotonic()
    run.text = "".join(pieces)
    return run


def _kill_generating(mesh: Mesh) -> None:
    for i, w in enumerate(mesh.workers):
        if stats(w).active_requests > 0:
            os.kill(child_pid(mesh, f"worker-{i}"), signal.SIGKILL)
            return
    raise RuntimeError("no worker was generating")


def _clear_caches(mesh: Mesh) -> None:
    import grpc

    from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

    for w in mesh.workers:
        with grpc.insecure_channel(w) as ch:
            worker_pb2_grpc.WorkerServiceStub(ch).ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(), timeout=10)
    time.sleep(0.3)  # the cleared events reach the router


def _prefill_seconds(mesh: Mesh, positions: int, seed: int) -> float:
    body = {"model": "mocker", "max_tokens": 1, "prompt_embeds": _rows(positions, seed)}
    t0 = time.monotonic()
    r = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"the prefill request failed: {r.status_code} {r.text[:300]}")
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=0, help="SIGKILLs, each in a fresh mesh (default 20, --quick 5)")
    ap.add_argument("--quick", action="store_true", help="5 kills")
    ap.add_argument("--kill-after", type=int, default=10, help="text chunks before the SIGKILL")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=200, help="prompt positions (words or rows)")
    ap.add_argument("--decode-ms", type=float, default=30.0)
    ap.add_argument("--prefill-ms", type=float, default=2.0, help="per uncached position")
    a = ap.parse_args()
    a.kills = a.kills or (5 if a.quick else 20)
    env = {"EMBEDMESH_WORKER_MOCKER_DECODE_MS": str(a.decode_ms), "EMBEDMESH_WORKER_MOCKER_DECODE_MS_PER_SEQ": "0",
           "EMBEDMESH_WORKER_MOCKER_PREFILL_MS_PER_TOKEN": str(a.prefill_ms)}
    survived = 0
    ratios: list[float] = []
    for k in range(a.kills):
        # A fresh mesh per kill: the launcher stops a mesh once none of the workers it started is left.
        mesh = start_mesh(workers=2, engine="mocker", env=env,
                          extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
        try:
            wait_registered(str(mesh.extra["router"]), 2)
            kind = KINDS[k % len(KINDS)]
            path, body = _body(kind, 1000 + k, a.max_tokens, a.prompt_len)
            calm = _stream(mesh, path, body)
            _clear_caches(mesh)  # the continuation prefills its positions, none found cached from the calm run
            cut = _stream(mesh, path, body, a.kill_after, lambda m=mesh: _kill_generating(m))
            positions = int(cut.usage.get("prompt_tokens", 0)) + cut.sent_before_kill
            prefill = _prefill_seconds(mesh, positions, 5000 + k)
        finally:
            mesh.stop()
        gaps = [b - t for t, b in zip(calm.times, calm.times[1:], strict=False)]
        added = cut.kill_gap - statistics.median(gaps)
        ok = (cut.error is None and cut.done and cut.text == calm.text
              and cut.usage.get("completion_tokens") == a.max_tokens)
        survived += ok
        ratios.append(added / prefill)
        print(f"kill {k + 1:2d} {kind:6s} survived={ok} after={cut.sent_before_kill} chunks "
              f"gap={cut.kill_gap * 1000:.0f} ms added={added * 1000:.0f} ms prefill({positions} positions)="
              f"{prefill * 1000:.0f} ms ratio={added / prefill:.2f}"
              + ("" if ok else f" error={cut.error} same_text={cut.text == calm.text}"), flush=True)
    ratios.sort()
    p90 = ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))]
    print(f"migration: survived={survived}/{a.kills} added_over_prefill_p50={statistics.median(ratios):.2f} "
          f"p90={p90:.2f} max={ratios[-1]:.2f}")


if __name__ == "__main__":
    main()

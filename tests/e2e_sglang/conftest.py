"""A mesh whose embedding worker is SGLang (sglang==0.5.23, CPU): the worker runs in the SGLang venv built by
``scripts/sglang_venv.sh`` with the source tree on PYTHONPATH; the preprocessor and gateway run here.
Every test here is skipped, saying why, when that venv is absent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.mesh import free_port

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EMBEDMESH_CACHE", Path.home() / ".cache" / "embedmesh"))
SGLANG_VENV = Path(os.environ.get("EMBEDMESH_SGLANG_VENV", CACHE / "venvs" / "sglang-0.5.23"))
MODEL = "all-MiniLM-L6-v2"


def sglang_python() -> Path:
    py = SGLANG_VENV / "bin" / "python"
    if not (SGLANG_VENV / ".complete").exists() or not py.exists():
        pytest.skip(f"the SGLang venv is absent ({SGLANG_VENV}); build it with `bash scripts/sglang_venv.sh`")
    return py


@dataclass
class SGLangMesh:
    procs: list[tuple[str, subprocess.Popen[bytes]]]
    gateway_port: int
    worker: str
    log_dir: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def log_tail(self, n: int = 3000) -> str:
        logs = sorted(self.log_dir.glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in logs)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def start_sglang_mesh(log_dir: Path, timeout: float = 400) -> SGLangMesh:
    py = sglang_python()
    worker_port, pre_port, gw_port = free_port(), free_port(), free_port()
    worker = f"127.0.0.1:{worker_port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDMESH_TRACE_CONSOLE": "0"}
    worker_env = {**env, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "gateway", "gen/python"))
                  + os.pathsep + str(REPO)}
    log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(name: str, cmd: list[str], e: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, start_new_session=True, cwd=REPO)

    procs = [("sglang-worker", spawn("sglang-worker", [str(py), str(Path(__file__).parent / "run_worker.py"),
                                                       "--engine", "sglang", "--model", "default", "--host",
                                                       "127.0.0.1", "--port", str(worker_port)], worker_env))]
    procs.append(("preprocessor", spawn("preprocessor", [sys.executable, "-m", "embedmesh.services.preprocessor.main",
                                                         "--host", "127.0.0.1", "--port", str(pre_port),
                                                         "--workers", worker], env)))
    procs.append(("gateway", spawn("gateway", [sys.executable, "-m", "embedmesh.gateway.main", "--host", "127.0.0.1",
                                               "--port", str(gw_port), "--preprocessor", f"127.0.0.1:{pre_port}"],
                                   env)))
    mesh = SGLangMesh(procs, gw_port, worker, log_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [n for n, p in procs if p.poll() is not None]
        if dead:
            mesh.stop()
            raise RuntimeError(f"{dead} exited while starting:\n{mesh.log_tail()}")
        try:
            r = httpx.post(f"{mesh.base_url}/v1/embeddings", json={"model": MODEL, "input": "ready?"}, timeout=30)
            if r.status_code == 200:
                return mesh
        except httpx.HTTPError:
            pass
        time.sleep(1)
    mesh.stop()
    raise RuntimeError(f"the sglang mesh did not get ready in {timeout} s:\n{mesh.log_tail()}")


@pytest.fixture(scope="session")
def sglang_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangMesh]:
    mesh = start_sglang_mesh(tmp_path_factory.mktemp("sglang-mesh"))
    yield mesh
    mesh.stop()


@pytest.fixture
def client(sglang_mesh: SGLangMesh) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{sglang_mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

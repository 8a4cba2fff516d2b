"""The vllm worker while vLLM loads (the real worker main, in the vLLM venv): its port answers at once, readiness
is NOT_SERVING while liveness is SERVING (so Kubernetes neither routes to it nor restarts it), and a request sent
before the engine is ready waits and then completes instead of failing. Skipped, saying why, without the venv."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.common.v1 import common_pb2
from embedmesh.core.server import LIVENESS
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e_vllm.test_vllm_mesh import VENV
from tests.support.mesh import free_port
from tests.support.worker_generate import worker_generate

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WORKER = "embedmesh.worker.v1.WorkerService"


def _status(stub: Any, service: str) -> int | None:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
    except grpc.RpcError:
        return None


def test_readiness_waits_for_the_engine_and_early_requests_wait_too(tmp_path: Path) -> None:
    py = VENV / "bin" / "python"
    if not (VENV / ".complete").exists() or not py.exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    from embedmesh.models import ensure_default_model

    folder = Path(ensure_default_model())
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDMESH_TRACE_CONSOLE": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "gateway", "gen/python"))}
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(py), "-m", "embedmesh.services.worker.main", "--engine", "vllm", "--host",
                                 "127.0.0.1", "--port", str(port), "--model", str(folder), "--served-name",
                                 "SmolLM2-135M-Instruct", "--ready-timeout", "400"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while (ready := _status(health, WORKER)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        # The port answers within a second or two of the start; vLLM takes far longer than that to load.
        assert ready == health_pb2.HealthCheckResponse.NOT_SERVING, "ready before vLLM could have loaded"
        assert _status(health, LIVENESS) == health_pb2.HealthCheckResponse.SERVING

        result: dict[str, Any] = {}

        def early() -> None:
            req = worker_pb2.GenerateRequest(
                request_id="early", segments=[worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=[504, 3575]))],
                sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            try:
                result["responses"] = list(worker_generate(worker_pb2_grpc.WorkerServiceStub(channel), req,
                                                                 timeout=400))
            except grpc.RpcError as e:
                result["error"] = e

        t = threading.Thread(target=early)
        t.start()
        time.sleep(0.5)
        # Still loading while the request is in: it must be waiting, not refused.
        assert _status(health, WORKER) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert t.is_alive(), f"the early request ended before the engine was ready: {result}"
        t.join(420)
        assert "error" not in result, f"early request failed: {result.get('error')}"
        responses = result["responses"]
        assert sum(len(r.token_ids) for r in responses) == 3
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert _status(health, WORKER) == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

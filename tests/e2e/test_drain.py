"""Drain on a real mesh with two hf workers: SIGTERM one worker while 16 streams are in flight through the gateway;
every stream completes (zero failures), the drained worker leaves the router at once and exits when its streams are
done, and the mesh goes on serving with the other worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.e2e.conftest import MODEL
from tests.support.load import Outcome, child_pid, stats, stream_completion
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

STREAMS = 16
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mesh2() -> Iterator[Mesh]:
    m = start_mesh(workers=2)
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


def test_health_lists_every_service(mesh2: Mesh) -> None:
    r = httpx.get(f"{mesh2.base_url}/health", timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok"
    kinds = sorted(s["service"] for s in body["services"])
    # No "router" entry with one replica: it runs inside the preprocessor (the launcher's default).
    assert mesh2.extra["router"] == mesh2.preprocessor
    assert kinds == ["embedding-worker", "gateway", "preprocessor", "vector-store", "worker", "worker"]
    assert all(s["status"] == "serving" for s in body["services"])
    assert {s["model"] for s in body["services"] if s["service"] == "worker"} == {MODEL}
    assert not any(w in r.text for w in mesh2.workers), "health must not name internal addresses"


def test_sigterm_of_a_worker_under_16_streams_loses_nothing(mesh2: Mesh) -> None:
    assert _wait(lambda: len(_registered(mesh2)) == 2)
    victim, survivor = mesh2.workers
    pid = child_pid(mesh2, "worker-0")
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    firsts = [threading.Event() for _ in range(STREAMS)]

    def one(i: int) -> None:
        o = stream_completion(mesh2.base_url, MODEL, f"Stream {i}: write about mountains number {i}.", MAX_TOKENS,
                              first_token=firsts[i])
        with lock:
            outcomes.append(o)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    # Every stream has produced output, so all 16 are in flight; the victim is serving some of them.
    assert all(e.wait(300) for e in firsts), "the streams did not all start"
    in_flight = stats(victim).active_requests
    assert in_flight > 0, "worker-0 had no stream in flight; the drain would prove nothing"
    os.kill(pid, signal.SIGTERM)
    # The draining worker leaves the router at once, while its streams are still running.
    assert _wait(lambda: _registered(mesh2) == [survivor], 30)
    assert any(t.is_alive() for t in threads), "the router still listed the worker after its streams ended"
    for t in threads:
        t.join(300)
    assert len(outcomes) == STREAMS
    failures = [o for o in outcomes if o.kind != "ok"]
    assert failures == []
    assert all(o.finish_reason == "length" for o in outcomes)
    # It exits on its own once its streams are done (well before the 30 s drain bound would cut them).
    assert _wait(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
                 60)
    # The mesh goes on serving with the other worker; every new request lands there.
    before = stats(survivor).completed_requests
    after = [stream_completion(mesh2.base_url, MODEL, f"After the drain {i}", 4) for i in range(3)]
    assert [o.kind for o in after] == ["ok"] * 3
    assert stats(survivor).completed_requests == before + 3

"""KV-aware routing on a real mesh with two hf workers and the router: a repeated long prompt (text, and
separately embeddings) lands on the worker that served it first, unrelated prompts spread out, and a worker killed
under load gets no request afterwards."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of
from tests.support.load import Load, child_pid, metric, retryable, stats
from tests.support.mesh import Mesh, start_mesh
from tests.support.route_many import route

pytestmark = pytest.mark.e2e

LONG = ("You are a meticulous assistant who answers questions about European geography with short, precise "
        "sentences, always naming the country first and the city second, never guessing. ") * 3


@pytest.fixture(scope="module")
def mesh2() -> Iterator[Mesh]:
    m = start_mesh(workers=2)
    yield m
    m.stop()


def completed(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10) \
            .completed_requests


def served_by(mesh: Mesh, body: dict[str, Any]) -> str:
    before = {w: completed(w) for w in mesh.workers}
    r = httpx.post(f"{mesh.base_url}/v1/completions", json={"model": MODEL, "max_tokens": 2, "temperature": 0,
                                                            **body}, timeout=120)
    assert r.status_code == 200, r.text
    changed = [w for w in mesh.workers if completed(w) > before[w]]
    assert len(changed) == 1
    return changed[0]


def wait_registered(mesh: Mesh, count: int, router: str = "") -> list[router_pb2.WorkerInfo]:
    """The workers registered with the router (``router``: its address, default the mesh's router service)."""
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(router or str(mesh.extra["router"])) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        while time.monotonic() < deadline:
            workers = list(stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers)
            if len(workers) == count:
                return workers
            time.sleep(0.2)
    raise AssertionError(f"expected {count} registered workers")


def test_both_workers_register(mesh2: Mesh) -> None:
    workers = wait_registered(mesh2, 2)
    assert sorted(w.registration.address for w in workers) == sorted(mesh2.workers)
    # hf workers publish their prefix cache's KV events (engines/hf/prefix_cache.py): the router indexes them.
    assert all(w.registration.model == MODEL and w.registration.publishes_kv_events for w in workers)


def test_repeated_text_prompt_sticks_unrelated_prompts_spread(mesh2: Mesh) -> None:
    wait_registered(mesh2, 2)
    first = served_by(mesh2, {"prompt": LONG + "Question one?"})
    for i in range(3):
        assert served_by(mesh2, {"prompt": LONG + f"Question {i + 2}?"}) == first
    others = {served_by(mesh2, {"prompt": f"{i} unrelated short prompt number {i} about cooking pasta"})
              for i in range(6)}
    assert len(others) == 2, "unrelated prompts all went to one worker"


def test_repeated_embeddings_prompt_sticks(mesh2: Mesh, embeds_of: Any) -> None:
    wait_registered(mesh2, 2)
    payload = b64_of(embeds_of(LONG.replace("European", "Asian")))
    first = served_by(mesh2, {"prompt": "", "prompt_embeds": payload})
    for _ in range(3):
        assert served_by(mesh2, {"prompt": "", "prompt_embeds": payload}) == first


def test_route_decision_is_visible_over_grpc(mesh2: Mesh) -> None:
    from embedmesh.core.block_hash import block_hashes
    from embedmesh.models import ensure_default_model
    from embedmesh.services.preprocessor.prompts import Tokenizer

    ids = Tokenizer(ensure_default_model()).encode(LONG + "Question one?")
    hashes = block_hashes([ids], 16)
    with grpc.insecure_channel(mesh2.extra["router"]) as ch:
        r = route(router_pb2_grpc.RouterServiceStub(ch),
            router_pb2.RouteRequest(model=MODEL, block_hashes=hashes, block_size=16, prompt_tokens=len(ids)), timeout=5)
    assert r.overlap_blocks == len(hashes), "the router should know the whole prompt from the earlier test"
    assert len(r.candidates) == 2 and r.candidates[0].worker_id == r.worker_id
    assert r.candidates[0].cost < r.candidates[1].cost


def test_killed_worker_gets_no_more_requests(mesh2: Mesh) -> None:
    """Kill a worker that is serving load (not an idle one); once the router dropped it, every request goes to the
    survivor: its completed count grows by exactly the requests sent, and the preprocessor makes no failed call and
    no retry (nothing was sent to the dead worker)."""
    workers = wait_registered(mesh2, 2)
    victim = workers[0].registration.address
    survivor = next(w for w in mesh2.workers if w != victim)
    pid = child_pid(mesh2, f"worker-{mesh2.workers.index(victim)}")
    load = Load(mesh2.base_url, MODEL, clients=4, max_tokens=32)
    try:
        deadline = time.monotonic() + 300
        while stats(victim).active_requests == 0:
            assert time.monotonic() < deadline, "the load never reached the victim"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        wait_registered(mesh2, 1)
    finally:
        outcomes = load.stop()
    assert all(o.kind == "ok" or retryable(o) for o in outcomes)
    failures = metric(mesh2, "embedmesh_worker_call_failures_total")
    retries = metric(mesh2, "embedmesh_worker_retries_total")
    before = completed(survivor)
    for i in range(4):
        r = httpx.post(f"{mesh2.base_url}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": LONG + f"after the kill {i}", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert completed(survivor) == before + 4
    assert metric(mesh2, "embedmesh_worker_call_failures_total") == failures
    assert metric(mesh2, "embedmesh_worker_retries_total") == retries

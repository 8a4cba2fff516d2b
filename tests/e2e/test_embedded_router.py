"""The KV router inside the preprocessor (``make run``'s default with one router replica): no router process,
workers register on the preprocessor's port, ``ListWorkers`` answers there, a repeated long prompt sticks to the
worker that served it, unrelated prompts spread, and the router's metrics are the preprocessor's."""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.e2e.test_routing import LONG, served_by, wait_registered
from tests.support.load import metric
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    m = start_mesh(workers=2)  # the shipped default
    yield m
    m.stop()


def _registered(mesh: Mesh, count: int) -> list[router_pb2.WorkerInfo]:
    return wait_registered(mesh, count, router=mesh.preprocessor)


def test_no_router_process_and_workers_register_on_the_preprocessor(mesh: Mesh) -> None:
    started = re.findall(r"\[launcher\]\s+(\S+)\s+\S+\s+\(pid \d+\)", mesh.log_tail(100_000))
    assert "preprocessor" in started and "router" not in started, started
    workers = _registered(mesh, 2)
    assert sorted(w.registration.address for w in workers) == sorted(mesh.workers)
    assert mesh.extra["router"] == mesh.preprocessor  # the harness points router checks at the preprocessor
    with grpc.insecure_channel(mesh.extra["router_port"]) as ch:  # the router's own port: nobody listens
        with pytest.raises(grpc.RpcError) as e:
            router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_routing_in_process_keeps_prefixes_on_their_worker(mesh: Mesh) -> None:
    _registered(mesh, 2)
    before = metric(mesh, "embedmesh_router_decisions_total")
    first = served_by(mesh, {"prompt": LONG + "Question one?"})
    for i in range(3):
        assert served_by(mesh, {"prompt": LONG + f"Question {i + 2}?"}) == first
    others = {served_by(mesh, {"prompt": f"{i} unrelated short prompt number {i} about cooking pasta"})
              for i in range(6)}
    assert len(others) == 2, "unrelated prompts all went to one worker"
    assert metric(mesh, "embedmesh_router_decisions_total") >= before + 10, "decisions counted by the preprocessor"
    with grpc.insecure_channel(mesh.preprocessor) as ch:
        stats = router_pb2_grpc.RouterServiceStub(ch).GetIndexStats(router_pb2.GetIndexStatsRequest(), timeout=5)
    assert stats.routes >= 10 and stats.nodes > 0

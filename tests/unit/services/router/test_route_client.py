"""The preprocessor's router client: a live router's decision; when no router answers, None (counted in a metric;
the caller's worker pool is the one fallback); a failed router is skipped for a while."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import REGISTRY

from embedmesh.core.server import Server, ServerOptions
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.router.route_client import RouteClient
from tests.support.mesh import free_port
from tests.unit.services.router.test_servicer import FakeWorker, start_router, until


def fallbacks() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "embedmesh_router_fallback"
               for s in m.samples if s.name.endswith("_total"))


async def test_unreachable_router_means_fallback_and_a_metric() -> None:
    client = RouteClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], block_size=16, timeout=0.2)
    before = fallbacks()
    assert await client.route("m", [1, 2], 32, "r1") is None, "no worker known: the caller uses its own pool"
    assert await client.route("m", [1, 2], 32) is None
    assert fallbacks() == before + 2
    await client.close()


async def test_a_failed_router_is_skipped_until_retry_after() -> None:
    import time

    client = RouteClient([f"127.0.0.1:{free_port()}"], block_size=4, timeout=0.2, retry_after=30)
    t0 = time.monotonic()
    assert await client.route("m", [1], 4) is None
    assert client._down_until[0] > t0 + 29, "an unreachable router is marked down for retry_after"
    before = fallbacks()
    assert await client.route("m", [1], 4) is None  # skipped, not dialled again: no timeout spent
    assert fallbacks() == before + 1
    await client.close()


async def test_live_router_decides_and_an_outage_leaves_the_choice_to_the_caller() -> None:
    r = await start_router()
    client = RouteClient([r.address], block_size=4, timeout=0.5, retry_after=30)
    async with FakeWorker([r.address], "a") as a, FakeWorker([r.address], "b"):
        a.store(0, [1, 2])
        await until(lambda: r.index.blocks_of("a") == 2)
        d = await client.route("m", [1, 2], 9, "req-1")
        assert d is not None
        assert (d.worker_id, d.address, d.overlap_blocks) == ("a", a.link.registration.address, 2)
        assert [c.worker_id for c in d.candidates] == ["a", "b"] and d.candidates[0].cost < d.candidates[1].cost
        await r.close()
    before = fallbacks()
    outage = [await client.route("m", [1, 2], 9) for _ in range(2)]
    assert outage == [None, None]
    assert fallbacks() == before + 2
    await client.close()


async def test_questions_ride_one_route_many_stream() -> None:
    r = await start_router()
    client = RouteClient([r.address], block_size=4, timeout=2)
    async with FakeWorker([r.address], "a"):
        decisions = await asyncio.gather(*(client.route("m", [], 4, f"r{i}") for i in range(20)))
        assert {d.worker_id for d in decisions if d is not None} == {"a"} and None not in decisions
        stream = client._streams[0]
        assert stream._session is not None and not stream._session.closed
        assert stream._waiting == {}
    await client.close()
    await r.close()


class _SilentRouter(router_pb2_grpc.RouterServiceServicer):
    """Reads RouteMany questions and never answers; knows no Route either."""

    async def RouteMany(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for _ in request_iterator:
            pass
        return
        yield  # pragma: no cover


class _OldRouter(router_pb2_grpc.RouterServiceServicer):
    """A router without RouteMany (Route only)."""

    async def Route(self, request: Any, context: Any) -> Any:  # noqa: N802
        return router_pb2.RouteResponse(worker_id="old", address="127.0.0.1:1", overlap_blocks=0)


async def _serve(servicer: Any) -> Server:
    server = Server("r", ServerOptions(port=0, grace_seconds=0))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, "embedmesh.router.v1.RouterService")
    await server.start()
    return server


async def test_an_unanswered_question_times_out_as_a_deadline_and_the_router_is_skipped() -> None:
    import time

    server = await _serve(_SilentRouter())
    client = RouteClient([server.address], block_size=4, timeout=0.3, retry_after=30)
    t0 = time.monotonic()
    assert await client.route("m", [1], 4) is None
    assert 0.25 < time.monotonic() - t0 < 5
    assert client._down_until[0] > t0 + 29 and client._streams[0]._waiting == {}
    await client.close()
    await server.drain()


async def test_a_router_without_route_many_is_not_asked_with_route_calls() -> None:
    """The mesh ships from one version: UNIMPLEMENTED is a router that did not answer (the caller's pool decides,
    counted as a fallback by its reason), not a cue to ask with Route calls."""
    server = await _serve(_OldRouter())
    client = RouteClient([server.address], block_size=4, timeout=2)
    before = fallbacks()
    for _ in range(2):
        assert await client.route("m", [1], 4) is None
    assert fallbacks() == before + 2
    await client.close()
    await server.drain()

"""RouterService on real gRPC servers with workers played by RouterLink (the real worker-side client): events,
gaps and re-sync, liveness, re-registration, two router replicas, Route decisions and a bad-input table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import Server, ServerOptions, insecure_channel
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.router.registry import Registry
from embedmesh.services.router.scoring import Weights
from embedmesh.services.router.servicer import SERVICE_NAME, RouterServicer
from embedmesh.services.router.worker_client import LoadReport, RouterLink


class RouterUnderTest:
    def __init__(self, server: Server, servicer: RouterServicer, sweeper: asyncio.Task[None]) -> None:
        self.server, self.servicer, self.sweeper = server, servicer, sweeper
        self.channel = insecure_channel(server.address)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)

    @property
    def index(self) -> Any:
        return self.servicer.registry.index

    async def close(self) -> None:
        self.sweeper.cancel()
        await self.channel.close()
        await self.server.drain()


async def start_router(stale: float = 1.0) -> RouterUnderTest:
    registry = Registry(stale_seconds=stale, approx_ttl_seconds=60)
    servicer = RouterServicer(registry, Weights(), seed=0)
    server = Server("router-test", ServerOptions(port=0, grace_seconds=0.1))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start()
    await server.set_serving(True)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(0.1)
            registry.sweep()

    return RouterUnderTest(server, servicer, asyncio.create_task(sweep()))


@pytest.fixture
async def router() -> AsyncIterator[RouterUnderTest]:
    r = await start_router()
    yield r
    await r.close()


def link(routers: list[str], wid: str, events: bool = True, snapshot: Callable[[], Any] | None = None,
         load: int = 0) -> RouterLink:
    reg = router_pb2.Registration(worker_id=wid, address=f"127.0.0.1:{hash(wid) % 1000 + 40000}", model="m",
                                  block_size=4, engine="test", publishes_kv_events=events)
    return RouterLink(routers, reg, lambda: LoadReport(load), snapshot=snapshot, interval=0.1)


def stored(parent: int, hashes: list[int]) -> router_pb2.KvEvent:
    return router_pb2.KvEvent(stored=router_pb2.BlocksStored(parent_hash=parent, block_hashes=hashes))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def route(r: RouterUnderTest, hashes: list[int]) -> router_pb2.RouteResponse:
    return await r.stub.Route(router_pb2.RouteRequest(model="m", block_hashes=hashes, block_size=4))


async def test_events_drive_routing(router: RouterUnderTest) -> None:
    a, b = link([router.server.address], "a"), link([router.server.address], "b")
    a.start()
    b.start()
    await until(lambda: all(p.connected for p in a.peers + b.peers))
    a.publish([stored(0, [11, 12, 13])])
    await until(lambda: router.index.blocks_of("a") == 3)
    r = await route(router, [11, 12, 13, 14])
    assert r.worker_id == "a" and r.overlap_blocks == 3
    assert [c.worker_id for c in r.candidates] == ["a", "b"]
    a.publish([router_pb2.KvEvent(removed=router_pb2.BlocksRemoved(block_hashes=[12, 13]))])
    await until(lambda: router.index.blocks_of("a") == 1)
    a.publish([router_pb2.KvEvent(cleared=router_pb2.AllBlocksCleared())])
    await until(lambda: router.index.blocks_of("a") == 0)
    await a.close()
    await b.close()


async def test_gap_triggers_resync_with_snapshot(router: RouterUnderTest) -> None:
    a = link([router.server.address], "a", snapshot=lambda: [stored(0, [21, 22])])
    a.start()
    await until(lambda: a.peers[0].connected)
    a.publish([stored(0, [1])])
    await until(lambda: router.index.blocks_of("a") == 1)
    a.peers[0].next_event_id += 5  # lose events 2..6
    a.publish([stored(0, [99])])
    await until(lambda: router.index.find_matches([21, 22]) == {"a": 2})
    assert router.index.find_matches([1]) == {}, "the snapshot replaces what the router had"
    assert router.index.find_matches([99]) == {}
    await a.close()


async def test_broken_stream_and_silence_drop_the_worker_then_it_re_registers(router: RouterUnderTest) -> None:
    a = link([router.server.address], "a")
    a.start()
    await until(lambda: a.peers[0].connected)
    a.publish([stored(0, [5, 6])])
    await until(lambda: router.index.blocks_of("a") == 2)
    await a.close()  # stream breaks
    await until(lambda: "a" not in router.servicer.registry.workers)
    assert router.index.blocks_of("a") == 0
    again = link([router.server.address], "a")
    again.start()
    await until(lambda: "a" in router.servicer.registry.workers)
    again._tasks[0].cancel()  # silence without closing cleanly is covered by the stale sweep too
    await until(lambda: "a" not in router.servicer.registry.workers, timeout=5)
    await again.close()


async def test_two_routers_reach_the_same_index() -> None:
    r1, r2 = await start_router(), await start_router()
    a = link([r1.server.address, r2.server.address], "a")
    a.start()
    await until(lambda: all(p.connected for p in a.peers))
    a.publish([stored(0, [7, 8, 9])])
    await until(lambda: r1.index.blocks_of("a") == 3 and r2.index.blocks_of("a") == 3)
    assert r1.index.find_matches([7, 8, 9]) == r2.index.find_matches([7, 8, 9]) == {"a": 3}
    await a.close()
    await r1.close()
    await r2.close()


async def test_approximate_tracking_for_workers_without_events(router: RouterUnderTest) -> None:
    a, b = link([router.server.address], "a", events=False), link([router.server.address], "b", events=False)
    a.start()
    b.start()
    await until(lambda: len(router.servicer.registry.workers) == 2)
    first = await route(router, [31, 32, 33])
    await asyncio.sleep(0.25)  # a heartbeat resets the routed-since-load count
    second = await route(router, [31, 32, 33])
    assert second.worker_id == first.worker_id and second.overlap_blocks == 3
    other = await route(router, [41, 42, 43])
    assert other.worker_id != first.worker_id or other.overlap_blocks == 0
    await a.close()
    await b.close()


@pytest.mark.parametrize(
    "request_,field,code",
    [
        (router_pb2.RouteRequest(block_size=4), "model", grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=0), "block_size", grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="absent", block_size=4), "model", grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_bad_route_requests(router: RouterUnderTest, request_: Any, field: str, code: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router.stub.Route(request_)
    assert info.value.code() == code and from_rpc_error(info.value).field == field
    assert (await router.stub.GetIndexStats(router_pb2.GetIndexStatsRequest())) is not None


@pytest.mark.parametrize(
    "first,field",
    [
        (router_pb2.WorkerStreamRequest(load=router_pb2.Load()), "registration"),
        (router_pb2.WorkerStreamRequest(registration=router_pb2.Registration(address="x", model="m", block_size=4)),
         "registration.worker_id"),
        (router_pb2.WorkerStreamRequest(registration=router_pb2.Registration(worker_id="w", model="m", block_size=4)),
         "registration.address"),
        (router_pb2.WorkerStreamRequest(registration=router_pb2.Registration(worker_id="w", address="x",
                                                                              model="m", block_size=0)),
         "registration.block_size"),
    ],
)
async def test_bad_worker_streams(router: RouterUnderTest, first: Any, field: str) -> None:
    async def msgs() -> AsyncIterator[Any]:
        yield first

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in router.stub.WorkerStream(msgs()):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and from_rpc_error(info.value).field == field


async def test_block_size_mismatch(router: RouterUnderTest) -> None:
    a = link([router.server.address], "a")
    a.start()
    await until(lambda: a.peers[0].connected)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router.stub.Route(router_pb2.RouteRequest(model="m", block_size=16))
    assert from_rpc_error(info.value).field == "block_size"
    await a.close()

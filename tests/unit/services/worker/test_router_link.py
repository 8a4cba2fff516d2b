"""A worker's streams to its routers (``worker/router_link.py``), against fake routers on loopback: registration
first, the snapshot that opens a stream, event batches numbered per router, heartbeats with their load clamped,
re-sync answered with a fresh snapshot, and a broken stream reopened with a new registration and numbering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from embedmesh.core.server import Server, ServerOptions
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.worker.router_link import LoadReport, RouterLink


class _Router(router_pb2_grpc.RouterServiceServicer):
    """Records what each stream carried; the test sends re-syncs or ends the current stream."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.streams: list[list[router_pb2.WorkerStreamRequest]] = []
        self.outbox: asyncio.Queue[router_pb2.WorkerStreamResponse | None] = asyncio.Queue()

    async def WorkerStream(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        received: list[router_pb2.WorkerStreamRequest] = []
        self.streams.append(received)
        self.outbox = asyncio.Queue()
        outbox = self.outbox

        async def read() -> None:
            async for msg in request_iterator:
                if msg.WhichOneof("kind") == "registration" and not received:
                    outbox.put_nowait(router_pb2.WorkerStreamResponse(
                        registered=router_pb2.Registered(router_id=self.name)))
                received.append(msg)

        reader = asyncio.create_task(read())
        try:
            while (resp := await outbox.get()) is not None:
                yield resp
        finally:
            reader.cancel()

    def kinds(self, stream: int = -1) -> list[str]:
        return [m.WhichOneof("kind") for m in self.streams[stream]]

    def batches(self, stream: int = -1) -> list[router_pb2.KvEventBatch]:
        return [m.events for m in self.streams[stream] if m.WhichOneof("kind") == "events"]


async def _serve(router: _Router) -> Server:
    server = Server("router", ServerOptions(port=0, grace_seconds=0))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, router, "embedmesh.router.v1.RouterService")
    await server.start()
    return server


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def _stored(*hashes: int) -> router_pb2.KvEvent:
    return router_pb2.KvEvent(stored=router_pb2.BlocksStored(block_hashes=list(hashes)))


def _registration(publishes: bool = True) -> router_pb2.Registration:
    return router_pb2.Registration(worker_id="w-1", address="127.0.0.1:1", model="m", block_size=16, engine="vllm",
                                   publishes_kv_events=publishes)


def test_at_least_one_router_is_required() -> None:
    with pytest.raises(ValueError, match="at least one router address is required"):
        RouterLink([], _registration(), load=lambda: LoadReport(0))


def test_registration_snapshot_then_events_numbered_per_router() -> None:
    async def run() -> None:
        routers = [_Router("r0"), _Router("r1")]
        servers = [await _serve(r) for r in routers]
        snapshots = iter([[_stored(1, 2)], [_stored(3)]])
        link = RouterLink([s.address for s in servers], _registration(), load=lambda: LoadReport(2),
                          snapshot=lambda: next(snapshots), interval=60)
        link.publish([_stored(99)])  # no stream open yet: dropped (the opening snapshot covers it)
        link.start()
        await link.wait_registered()
        assert {p.router_id for p in link.peers} == {"r0", "r1"}
        link.publish([])  # nothing to send
        link.publish([_stored(4), _stored(5)])
        link.publish([router_pb2.KvEvent(cleared=router_pb2.AllBlocksCleared())])
        for r in routers:
            await _until(lambda r=r: len(r.batches()) == 3)
            assert r.kinds()[0] == "registration"
            assert r.streams[0][0].registration == _registration()
            b = r.batches()
            assert [(x.event_id, x.snapshot) for x in b] == [(1, True), (2, False), (3, False)]
            assert [list(e.stored.block_hashes) for e in b[1].events] == [[4], [5]]
            assert b[2].events[0].WhichOneof("kind") == "cleared"
        # Each stream opened with its own snapshot call.
        assert sorted(list(r.batches()[0].events[0].stored.block_hashes) for r in routers) == [[1, 2], [3]]
        await link.close()
        for s in servers:
            await s._server.stop(0)

    asyncio.run(run())


def test_heartbeats_carry_the_load_clamped() -> None:
    async def run() -> None:
        router = _Router("r")
        server = await _serve(router)
        loads = iter([LoadReport(-3, float("nan"), ("a",)), LoadReport(4, 1.5), LoadReport(1, -0.5),
                      LoadReport(2, 0.25, ("a", "b"))])
        last = LoadReport(0)

        def load() -> LoadReport:
            nonlocal last
            last = next(loads, last)
            return last

        link = RouterLink([server.address], _registration(publishes=False), load=load, interval=0.01)
        link.start()
        await _until(lambda: bool(router.streams) and router.kinds().count("load") >= 4)
        got = [m.load for m in router.streams[0] if m.WhichOneof("kind") == "load"][:4]
        assert [(x.active_requests, x.kv_usage, list(x.lora_adapters)) for x in got] == [
            (0, 0.0, ["a"]), (4, 1.0, []), (1, 0.0, []), (2, 0.25, ["a", "b"])]
        # A worker that does not publish events sends no snapshot.
        assert router.batches() == []
        await link.close()
        await server._server.stop(0)

    asyncio.run(run())


def test_a_resync_is_answered_with_a_fresh_snapshot_in_sequence() -> None:
    async def run() -> None:
        router = _Router("r")
        server = await _serve(router)
        held = [[_stored(1)]]
        link = RouterLink([server.address], _registration(), load=lambda: LoadReport(0),
                          snapshot=lambda: held[-1], interval=60)
        link.start()
        await link.wait_registered()
        link.publish([_stored(2)])
        held.append([_stored(1), _stored(2)])
        router.outbox.put_nowait(router_pb2.WorkerStreamResponse(resync=router_pb2.ResyncRequest(last_event_id=1)))
        await _until(lambda: len(router.batches()) == 3)
        b = router.batches()
        assert [(x.event_id, x.snapshot) for x in b] == [(1, True), (2, False), (3, True)]
        assert [list(e.stored.block_hashes) for e in b[2].events] == [[1], [2]]
        assert link.peers[0].resyncs == 1
        await link.close()
        await server._server.stop(0)

    asyncio.run(run())


def test_a_closed_stream_is_reopened_registered_again_and_numbered_from_one() -> None:
    async def run() -> None:
        router = _Router("r")
        server = await _serve(router)
        link = RouterLink([server.address], _registration(), load=lambda: LoadReport(0),
                          snapshot=lambda: [_stored(7)], interval=60, max_backoff=0.05)
        link.start()
        await link.wait_registered()
        link.publish([_stored(8)])
        await _until(lambda: len(router.batches()) == 2)
        router.outbox.put_nowait(None)  # the router ends the stream
        await _until(lambda: len(router.streams) == 2 and link.peers[0].registrations == 2)
        await _until(lambda: len(router.batches()) == 1)
        assert router.kinds()[0] == "registration"
        assert [(x.event_id, x.snapshot) for x in router.batches()] == [(1, True)]
        link.publish([_stored(9)])
        await _until(lambda: len(router.batches()) == 2)
        assert router.batches()[1].event_id == 2
        await link.close()
        assert not link.peers[0].connected and link.peers[0].queue is None
        await server._server.stop(0)

    asyncio.run(run())

"""What a worker runs to be routable: one long-lived stream per router replica carrying its registration,
a load heartbeat every ``interval`` seconds, and its KV events (each router gets every event, with its own
event-id sequence). A router's re-sync request is answered with a snapshot. Streams reconnect with backoff, and
a new stream re-registers cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from embedmesh.core.logs import get_logger
from embedmesh.core.server import insecure_channel
from embedmesh.router.v1 import router_pb2, router_pb2_grpc

__all__ = ["RouterLink", "LoadReport"]

log = get_logger(__name__)


@dataclass(frozen=True)
class LoadReport:
    active_requests: int
    kv_usage: float = 0.0


class _Peer:
    def __init__(self, address: str) -> None:
        self.address = address
        self.queue: asyncio.Queue[router_pb2.WorkerStreamRequest | None] = asyncio.Queue()
        self.next_event_id = 1
        self.connected = False


class RouterLink:
    def __init__(
        self,
        routers: Sequence[str],
        registration: router_pb2.Registration,
        load: Callable[[], LoadReport],
        snapshot: Callable[[], list[router_pb2.KvEvent]] | None = None,
        interval: float = 1.0,
    ) -> None:
        self.registration = registration
        self._load = load
        self._snapshot = snapshot or (lambda: [])
        self.interval = interval
        self.peers = [_Peer(a) for a in routers]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for peer in self.peers:
            self._tasks.append(asyncio.create_task(self._run(peer), name=f"router-link-{peer.address}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def publish(self, events: list[router_pb2.KvEvent]) -> None:
        """Send KV events to every router (dropped for a router that is not connected; it re-syncs on return)."""
        for peer in self.peers:
            if peer.connected:
                peer.queue.put_nowait(router_pb2.WorkerStreamRequest(
                    events=router_pb2.KvEventBatch(event_id=peer.next_event_id, events=events)))
                peer.next_event_id += 1

    async def _run(self, peer: _Peer) -> None:
        backoff = 0.2
        while True:
            channel = insecure_channel(peer.address)
            ticker = None
            try:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                peer.queue = asyncio.Queue()
                peer.next_event_id = 1
                peer.queue.put_nowait(router_pb2.WorkerStreamRequest(registration=self.registration))
                ticker = asyncio.create_task(self._tick(peer))
                call = stub.WorkerStream(self._messages(peer))
                async for resp in call:
                    kind = resp.WhichOneof("kind")
                    if kind == "registered":
                        peer.connected = True
                        backoff = 0.2
                        log.info("registered with router", extra={"router": peer.address,
                                                                  "router_id": resp.registered.router_id})
                    elif kind == "resync":
                        peer.queue.put_nowait(router_pb2.WorkerStreamRequest(events=router_pb2.KvEventBatch(
                            event_id=peer.next_event_id, events=self._snapshot(), snapshot=True)))
                        peer.next_event_id += 1
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.info("router stream ended; reconnecting", extra={"router": peer.address, "code": e.code().name})
            finally:
                peer.connected = False
                if ticker is not None:
                    ticker.cancel()
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _tick(self, peer: _Peer) -> None:
        while True:
            r = self._load()
            peer.queue.put_nowait(router_pb2.WorkerStreamRequest(
                load=router_pb2.Load(active_requests=r.active_requests, kv_usage=r.kv_usage)))
            await asyncio.sleep(self.interval)

    async def _messages(self, peer: _Peer) -> AsyncIterator[router_pb2.WorkerStreamRequest]:
        while True:
            msg = await peer.queue.get()
            if msg is None:
                return
            yield msg

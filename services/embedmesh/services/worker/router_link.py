"""What a worker runs to be routable: ``RouterLink`` keeps one long-lived ``WorkerStream`` open to every router
replica, carrying its registration, a load heartbeat every ``interval`` seconds, and its KV events.

Each router gets every event, under its own event-id sequence (1, 2, 3, ... per stream). A worker that publishes
events opens every stream with a snapshot of what it already caches, and answers a router's re-sync request with a
fresh snapshot. A stream that breaks (router restarted, network) is reopened with jittered exponential backoff and
re-registers cleanly; events published while a router is unreachable are not queued for it (the snapshot that
opens the next stream covers them).

Usage in a worker process::

    link = RouterLink(["router-0:50081", "router-1:50081"], registration,
                      load=lambda: LoadReport(engine.stats().active_requests),
                      snapshot=lambda: to_router_events(engine.kv_snapshot()))   # engines with KV events only
    link.start()
    engine.on_kv_events(lambda batch: link.publish(to_router_events(batch)))
    ...
    await link.close()
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from embedmesh.core.logs import get_logger
from embedmesh.core.server import insecure_channel
from embedmesh.router.v1 import router_pb2, router_pb2_grpc

__all__ = ["RouterLink", "LoadReport"]

log = get_logger(__name__)

_Queue = asyncio.Queue[router_pb2.WorkerStreamRequest | None]


@dataclass(frozen=True)
class LoadReport:
    """One heartbeat's load."""

    active_requests: int
    kv_usage: float = 0.0
    """Fraction of the KV cache in use, 0..1 (0 when the engine does not say)."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters loaded now (the router sends requests naming one only to workers listing it)."""


class _Peer:
    """One router replica and the state of the stream to it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.queue: _Queue | None = None
        """Outgoing messages of the open stream; None while no stream is open."""
        self.next_event_id = 1
        self.connected = False
        """The router acknowledged the registration on the current stream."""
        self.router_id = ""
        self.registrations = 0
        self.resyncs = 0

    def send_events(self, events: Sequence[router_pb2.KvEvent], snapshot: bool = False) -> None:
        if self.queue is None:
            return
        self.queue.put_nowait(router_pb2.WorkerStreamRequest(
            events=router_pb2.KvEventBatch(event_id=self.next_event_id, events=events, snapshot=snapshot)))
        self.next_event_id += 1


class RouterLink:
    """A worker's streams to every router replica (see the module docstring)."""

    def __init__(
        self,
        routers: Sequence[str],
        registration: router_pb2.Registration,
        load: Callable[[], LoadReport],
        snapshot: Callable[[], list[router_pb2.KvEvent]] | None = None,
        interval: float = 1.0,
        max_backoff: float = 5.0,
    ) -> None:
        if not routers:
            raise ValueError("at least one router address is required")
        self.registration = registration
        self._load = load
        self._snapshot = snapshot
        self.interval = interval
        self.max_backoff = max_backoff
        self.peers = [_Peer(a) for a in routers]
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random()

    def start(self) -> None:
        """Open the streams (in background tasks of the running loop)."""
        for peer in self.peers:
            self._tasks.append(asyncio.create_task(self._run(peer), name=f"router-link-{peer.address}"))

    async def close(self) -> None:
        """Close every stream; the routers drop this worker at once."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def wait_registered(self, timeout: float = 10.0) -> None:
        """Wait until every router acknowledged the registration (raises TimeoutError)."""
        async def all_connected() -> None:
            while not all(p.connected for p in self.peers):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_connected(), timeout)

    def publish(self, events: Sequence[router_pb2.KvEvent]) -> None:
        """Send one batch of KV events to every router with an open stream (in order, never blocking)."""
        if not events:
            return
        for peer in self.peers:
            peer.send_events(events)

    # --- one stream per router, reopened forever ------------------------------------------------------------
    async def _run(self, peer: _Peer) -> None:
        backoff = 0.1
        while True:
            channel = insecure_channel(peer.address)
            queue: _Queue = asyncio.Queue()
            ticker: asyncio.Task[None] | None = None
            try:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                peer.next_event_id = 1
                queue.put_nowait(router_pb2.WorkerStreamRequest(registration=self.registration))
                peer.queue = queue
                if self._snapshot is not None and self.registration.publishes_kv_events:
                    peer.send_events(self._snapshot(), snapshot=True)
                ticker = asyncio.create_task(self._tick(queue))
                call = stub.WorkerStream(self._messages(queue))
                async for resp in call:
                    kind = resp.WhichOneof("kind")
                    if kind == "registered":
                        peer.connected = True
                        peer.router_id = resp.registered.router_id
                        peer.registrations += 1
                        backoff = 0.1
                        log.info("registered with router", extra={"router": peer.address,
                                                                  "router_id": peer.router_id})
                    elif kind == "resync":
                        peer.resyncs += 1
                        log.info("router asked for a re-sync", extra={
                            "router": peer.address, "last_event_id": resp.resync.last_event_id})
                        peer.send_events(self._snapshot() if self._snapshot else [], snapshot=True)
                log.info("router closed the stream; reconnecting", extra={"router": peer.address})
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.info("router stream ended; reconnecting", extra={
                    "router": peer.address, "code": e.code().name, "details": e.details()})
            finally:
                peer.connected = False
                peer.queue = None
                if ticker is not None:
                    ticker.cancel()
                await channel.close()
            await asyncio.sleep(backoff * (0.5 + self._rng.random()))
            backoff = min(backoff * 2, self.max_backoff)

    async def _tick(self, queue: _Queue) -> None:
        while True:
            r = self._load()
            queue.put_nowait(router_pb2.WorkerStreamRequest(
                load=router_pb2.Load(active_requests=max(0, r.active_requests),
                                     kv_usage=min(max(r.kv_usage, 0.0), 1.0) if r.kv_usage == r.kv_usage else 0.0,
                                     lora_adapters=r.lora_adapters)))
            await asyncio.sleep(self.interval)

    @staticmethod
    async def _messages(queue: _Queue) -> AsyncIterator[router_pb2.WorkerStreamRequest]:
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg

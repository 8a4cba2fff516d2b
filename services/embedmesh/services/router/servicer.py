"""Thin gRPC adapter for ``RouterService``: protobuf in -> registry / KvRouter -> protobuf out.

``WorkerStream`` protocol (one stream per worker per router replica):

    worker -> router   Registration, then any mix of Load (heartbeat, ~1/s) and KvEventBatch (ids 1, 2, 3, ...)
    router -> worker   Registered, then ResyncRequest whenever a batch id skips ahead

A worker that publishes KV events starts each stream with a snapshot batch (``snapshot = true``) of what it
already caches, so a router that (re)starts learns the whole cache. A bad message ends the stream with
INVALID_ARGUMENT naming the field; the worker is dropped and its client reconnects.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from embedmesh.core.errors import InvalidArgument, to_status_message
from embedmesh.core.logs import get_logger
from embedmesh.core.server import Observed
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.router.metrics import DROPS, EVENTS, INDEX_BLOCKS, RESYNCS, WORKERS
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.registry import (
    BatchOutcome,
    Cleared,
    EventBatch,
    KvEvent,
    Registry,
    Removed,
    Stored,
    WorkerState,
)

__all__ = ["RouterServicer", "SERVICE_NAME", "update_gauges"]

ROUTE_METHOD = "/embedmesh.router.v1.RouterService/RouteMany.question"
"""What one RouteMany question is observed as (span name, RPC metrics: method ``RouteMany.question``); the stream
itself is observed as ``RouteMany``."""

SERVICE_NAME = "embedmesh.router.v1.RouterService"

log = get_logger(__name__)



def update_gauges(registry: Registry) -> None:
    """Refresh the gauges (called by the sweeper: counting pairs is O(workers))."""
    WORKERS.set(len(registry.workers))
    INDEX_BLOCKS.labels("nodes").set(registry.index.node_count)
    INDEX_BLOCKS.labels("worker_blocks").set(registry.index.worker_block_count)


def _require(value: object, field: str, what: str = "is required") -> None:
    if not value:
        raise InvalidArgument(f"{field}: {what}", field=field, reason="REQUIRED")


def _registration(msg: router_pb2.WorkerStreamRequest | None) -> WorkerState:
    if msg is None or msg.WhichOneof("kind") != "registration":
        raise InvalidArgument("registration: the first message of a worker stream must be the registration",
                              field="registration", reason="REGISTRATION_FIRST")
    reg = msg.registration
    _require(reg.worker_id, "registration.worker_id")
    _require(reg.address, "registration.address", "is required (host:port of the WorkerService)")
    _require(reg.model, "registration.model")
    if reg.block_size < 1:
        raise InvalidArgument("registration.block_size: must be >= 1", field="registration.block_size",
                              reason="OUT_OF_RANGE")
    return WorkerState(reg.worker_id, reg.address, reg.model, reg.block_size, reg.engine, reg.publishes_kv_events)


MAX_ADAPTERS = 1024
"""LoRA adapters one heartbeat may list."""
MAX_ADAPTER_NAME = 256


def _adapter_name(name: str, field: str) -> str:
    if len(name) > MAX_ADAPTER_NAME or any(c.isspace() for c in name):
        raise InvalidArgument(f"{field}: an adapter name has no spaces and at most {MAX_ADAPTER_NAME} characters",
                              field=field, reason="INVALID_NAME")
    return name


def _load(load: router_pb2.Load) -> tuple[int, float, frozenset[str]]:
    if not (math.isfinite(load.kv_usage) and 0 <= load.kv_usage <= 1):
        raise InvalidArgument(f"load.kv_usage: must be in [0, 1], got {load.kv_usage}", field="load.kv_usage",
                              reason="OUT_OF_RANGE")
    if len(load.lora_adapters) > MAX_ADAPTERS:
        raise InvalidArgument(f"load.lora_adapters: at most {MAX_ADAPTERS} adapters, got {len(load.lora_adapters)}",
                              field="load.lora_adapters", reason="TOO_MANY")
    adapters = frozenset(_adapter_name(a, "load.lora_adapters") for a in load.lora_adapters if a)
    return load.active_requests, load.kv_usage, adapters


def _batch(state: WorkerState, batch: router_pb2.KvEventBatch) -> EventBatch:
    if not state.publishes_kv_events:
        raise InvalidArgument("events: this worker registered with publishes_kv_events = false",
                              field="events", reason="EVENTS_NOT_ANNOUNCED")
    if batch.event_id < 1:
        raise InvalidArgument("events.event_id: must be >= 1", field="events.event_id", reason="OUT_OF_RANGE")
    events: list[KvEvent] = []
    for i, ev in enumerate(batch.events):
        kind = ev.WhichOneof("kind")
        if kind == "stored":
            if 0 in ev.stored.block_hashes:
                raise InvalidArgument("0 is the root, never a block's hash",
                                      field=f"events.events[{i}].stored.block_hashes", reason="ROOT_HASH")
            events.append(Stored(ev.stored.parent_hash, list(ev.stored.block_hashes)))
        elif kind == "removed":
            events.append(Removed(list(ev.removed.block_hashes)))
        elif kind == "cleared":
            events.append(Cleared())
        else:
            raise InvalidArgument("one of stored, removed, cleared must be set", field=f"events.events[{i}]",
                                  reason="EMPTY_EVENT")
    return EventBatch(batch.event_id, events, batch.snapshot)


def _count(batch: EventBatch) -> None:
    for ev in batch.events:
        EVENTS.labels(type(ev).__name__.lower()).inc()


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: KvRouter) -> None:
        self.router = router
        self.registry = router.registry
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.draining = False
        """Set when a drain starts: each RouteMany stream ends after answering its next message, so open streams
        do not hold the drain for its whole grace (the caller opens a stream to another replica)."""

    async def WorkerStream(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[router_pb2.WorkerStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.WorkerStreamResponse]:
        state = self.registry.register(_registration(await anext(request_iterator, None)))
        wid = state.worker_id
        log.info("worker registered", extra={"worker_id": wid, "address": state.address, "model": state.model,
                                             "block_size": state.block_size, "engine": state.engine,
                                             "kv_events": state.publishes_kv_events})
        cause = "stream_ended"
        try:
            yield router_pb2.WorkerStreamResponse(registered=router_pb2.Registered(router_id=self.router_id))
            async for msg in request_iterator:
                if not self.registry.is_live(state):
                    cause = "replaced_or_stale"
                    break  # dropped as silent, or replaced by a newer registration of the same id
                kind = msg.WhichOneof("kind")
                if kind == "load":
                    self.registry.heartbeat(state, *_load(msg.load))
                elif kind == "events":
                    batch = _batch(state, msg.events)
                    outcome = self.registry.apply(state, batch)
                    if outcome is BatchOutcome.APPLIED:
                        _count(batch)
                    elif outcome is BatchOutcome.GAP:
                        RESYNCS.inc()
                        log.warning("event gap; asking for a re-sync", extra={
                            "worker_id": wid, "expected": state.last_event_id + 1, "got": batch.event_id})
                        yield router_pb2.WorkerStreamResponse(
                            resync=router_pb2.ResyncRequest(last_event_id=state.last_event_id))
                elif kind == "registration":
                    raise InvalidArgument("registration: sent twice on one stream", field="registration",
                                          reason="DUPLICATE_REGISTRATION")
                else:
                    raise InvalidArgument("one of registration, load, events must be set", field="kind",
                                          reason="EMPTY_MESSAGE")
        except InvalidArgument:
            cause = "bad_message"
            raise
        except asyncio.CancelledError:
            cause = "stream_broken"
            raise
        finally:
            if self.registry.drop(wid, state.session):
                DROPS.labels(cause).inc()
                log.info("worker left", extra={"worker_id": wid, "cause": cause})

    async def RouteMany(  # noqa: N802
        self, request_iterator: AsyncIterator[router_pb2.RouteManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouteManyResponse]:
        # Deciding is synchronous: each message's questions are answered at once, in one message.
        async for message in request_iterator:
            yield router_pb2.RouteManyResponse(answers=[self._answer(q) for q in message.questions])
            if self.draining:
                return

    async def start_drain(self) -> None:
        self.draining = True

    def _answer(self, question: router_pb2.RouteQuestion) -> router_pb2.RouteAnswer:
        """One RouteMany question, observed (span, RPC metrics) and answered on its own."""
        with Observed(ROUTE_METHOD, list(question.trace_context.items())) as obs:
            try:
                if question.id == 0:
                    raise InvalidArgument("questions[].id must be >= 1", field="id", reason="OUT_OF_RANGE")
                if not question.HasField("request"):
                    raise InvalidArgument(f"question {question.id}: request is required", field="request",
                                          reason="REQUIRED")
                return router_pb2.RouteAnswer(id=question.id, response=self._route(question.request))
            except Exception as e:  # noqa: BLE001 - as for a call: its status, or INTERNAL with an incident
                return router_pb2.RouteAnswer(id=question.id, error=to_status_message(obs.failed(e)))

    def _route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        d = self.router.route(request.model, request.block_hashes, request.block_size, request.prompt_tokens,
                              request.request_id, _adapter_name(request.lora_adapter, "lora_adapter"))
        return router_pb2.RouteResponse(
            worker_id=d.worker_id, address=d.address, overlap_blocks=d.overlap_blocks,
            adapter_missing=d.adapter_missing,
            candidates=[router_pb2.Candidate(worker_id=s.worker_id, address=address, overlap_blocks=s.overlap,
                                             cost=s.cost, active_requests=s.active)
                        for s, address in d.candidates],
        )

    async def ListWorkers(  # noqa: N802
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        now = time.monotonic()
        index = self.registry.index
        return router_pb2.ListWorkersResponse(workers=[
            router_pb2.WorkerInfo(
                registration=router_pb2.Registration(worker_id=w.worker_id, address=w.address, model=w.model,
                                                     block_size=w.block_size, engine=w.engine,
                                                     publishes_kv_events=w.publishes_kv_events),
                load=router_pb2.Load(active_requests=w.active_requests, kv_usage=w.kv_usage,
                                     lora_adapters=sorted(w.adapters)),
                blocks=index.blocks_of(w.worker_id), last_event_id=w.last_event_id,
                idle_seconds=now - w.last_seen,
            )
            for w in sorted(self.registry.workers.values(), key=lambda w: w.worker_id)
        ])

    async def GetIndexStats(  # noqa: N802
        self, request: router_pb2.GetIndexStatsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetIndexStatsResponse:
        index = self.registry.index
        return router_pb2.GetIndexStatsResponse(nodes=index.node_count, worker_blocks=index.worker_block_count,
                                                routes=self.router.routes)

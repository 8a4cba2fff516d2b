"""Thin gRPC adapter for ``RouterService`` over the registry, indexer and scoring."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter, Histogram

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.router.registry import Registry, WorkerState
from embedmesh.services.router.scoring import Weights, choose, score

__all__ = ["RouterServicer", "SERVICE_NAME"]

SERVICE_NAME = "embedmesh.router.v1.RouterService"

log = get_logger(__name__)

ROUTES = Counter("embedmesh_router_decisions_total", "Route decisions by model and whether any prefix matched",
                 ["model", "hit"])
OVERLAP = Histogram("embedmesh_router_overlap_ratio", "Matched prefix blocks / prompt blocks of the chosen worker",
                    ["model"], buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
RESYNCS = Counter("embedmesh_router_resyncs_total", "Re-syncs asked of workers after an event-id gap")


def _require(value: object, field: str, what: str) -> None:
    if not value:
        raise InvalidArgument(f"{field}: {what}", field=field, reason="REQUIRED")


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, registry: Registry, weights: Weights, seed: int | None = None) -> None:
        self.registry = registry
        self.weights = weights
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.rng = random.Random(seed)
        self.routes = 0

    async def WorkerStream(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[router_pb2.WorkerStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.WorkerStreamResponse]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "registration":
            raise InvalidArgument("registration: the first message must be the registration", field="registration",
                                  reason="REGISTRATION_FIRST")
        reg = first.registration
        _require(reg.worker_id, "registration.worker_id", "is required")
        _require(reg.address, "registration.address", "is required (host:port of the WorkerService)")
        _require(reg.model, "registration.model", "is required")
        if reg.block_size < 1:
            raise InvalidArgument("registration.block_size: must be >= 1", field="registration.block_size",
                                  reason="OUT_OF_RANGE")
        state = self.registry.register(WorkerState(reg.worker_id, reg.address, reg.model, reg.block_size, reg.engine,
                                                   reg.publishes_kv_events))
        log.info("worker registered", extra={"worker_id": reg.worker_id, "address": reg.address,
                                             "model": reg.model, "kv_events": reg.publishes_kv_events})
        yield router_pb2.WorkerStreamResponse(registered=router_pb2.Registered(router_id=self.router_id))
        awaiting_snapshot = False
        try:
            async for msg in request_iterator:
                if self.registry.workers.get(reg.worker_id) is not state:
                    break  # dropped as stale, or replaced by a newer registration
                state.last_seen = time.monotonic()
                kind = msg.WhichOneof("kind")
                if kind == "load":
                    state.active_requests = msg.load.active_requests
                    state.kv_usage = msg.load.kv_usage
                    state.routed_since_load = 0
                elif kind == "events":
                    batch = msg.events
                    if batch.snapshot:
                        self.registry.index.cleared(reg.worker_id)
                        awaiting_snapshot = False
                    elif awaiting_snapshot:
                        continue
                    elif batch.event_id != state.last_event_id + 1:
                        awaiting_snapshot = True
                        RESYNCS.inc()
                        log.warning("event gap; asking for a re-sync", extra={
                            "worker_id": reg.worker_id, "expected": state.last_event_id + 1, "got": batch.event_id})
                        yield router_pb2.WorkerStreamResponse(
                            resync=router_pb2.ResyncRequest(last_event_id=state.last_event_id))
                        continue
                    self._apply(reg.worker_id, batch)
                    state.last_event_id = batch.event_id
                else:
                    raise InvalidArgument("registration: sent twice on one stream", field="registration",
                                          reason="DUPLICATE_REGISTRATION")
        finally:
            if self.registry.drop(reg.worker_id, state.session):
                log.info("worker left", extra={"worker_id": reg.worker_id})

    def _apply(self, worker_id: str, batch: router_pb2.KvEventBatch) -> None:
        index = self.registry.index
        for ev in batch.events:
            kind = ev.WhichOneof("kind")
            if kind == "stored":
                index.stored(worker_id, ev.stored.parent_hash, ev.stored.block_hashes)
            elif kind == "removed":
                index.removed(worker_id, ev.removed.block_hashes)
            elif kind == "cleared":
                index.cleared(worker_id)

    async def Route(  # noqa: N802
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        _require(request.model, "model", "is required")
        if request.block_size < 1:
            raise InvalidArgument("block_size: must be >= 1", field="block_size", reason="OUT_OF_RANGE")
        candidates = self.registry.candidates(request.model)
        if not candidates:
            raise Unavailable(f"model: no live worker registered for {request.model!r}", field="model",
                              reason="NO_WORKER")
        matching = [w for w in candidates if w.block_size == request.block_size]
        if not matching:
            sizes = sorted({w.block_size for w in candidates})
            raise InvalidArgument(f"block_size: workers of {request.model!r} use block sizes {sizes}, "
                                  f"got {request.block_size}", field="block_size", reason="BLOCK_SIZE_MISMATCH")
        hashes = list(request.block_hashes)
        overlaps = self.registry.index.find_matches(hashes)
        scored = score(len(hashes), overlaps, {w.worker_id: w.load for w in matching}, self.weights)
        best = choose(scored, self.weights, self.rng)
        chosen = self.registry.workers[best.worker_id]
        self.registry.record_routed(best.worker_id, hashes)
        self.routes += 1
        ROUTES.labels(request.model, "yes" if best.overlap else "no").inc()
        if hashes:
            OVERLAP.labels(request.model).observe(best.overlap / len(hashes))
        log.info("route", extra={"request_id": request.request_id, "model": request.model, "worker": best.worker_id,
                                 "overlap": best.overlap, "blocks": len(hashes),
                                 "costs": {s.worker_id: s.cost for s in scored}})
        by_id = {w.worker_id: w for w in matching}
        return router_pb2.RouteResponse(
            worker_id=best.worker_id, address=chosen.address, overlap_blocks=best.overlap,
            candidates=[router_pb2.Candidate(worker_id=s.worker_id, address=by_id[s.worker_id].address,
                                             overlap_blocks=s.overlap, cost=s.cost, active_requests=s.active)
                        for s in scored],
        )

    async def ListWorkers(  # noqa: N802
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        now = time.monotonic()
        return router_pb2.ListWorkersResponse(workers=[
            router_pb2.WorkerInfo(
                registration=router_pb2.Registration(worker_id=w.worker_id, address=w.address, model=w.model,
                                                     block_size=w.block_size, engine=w.engine,
                                                     publishes_kv_events=w.publishes_kv_events),
                load=router_pb2.Load(active_requests=w.active_requests, kv_usage=w.kv_usage),
                blocks=self.registry.index.blocks_of(w.worker_id), last_event_id=w.last_event_id,
                idle_seconds=now - w.last_seen,
            )
            for w in sorted(self.registry.workers.values(), key=lambda w: w.worker_id)
        ])

    async def GetIndexStats(  # noqa: N802
        self, request: router_pb2.GetIndexStatsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetIndexStatsResponse:
        return router_pb2.GetIndexStatsResponse(nodes=self.registry.index.node_count,
                                                worker_blocks=self.registry.index.worker_block_count,
                                                routes=self.routes)

"""What the preprocessor calls: ``await client.route(model, hashes, prompt_len)`` -> a ``RouteDecision``, or None.

Router replicas are tried in turn (a different one first each call). When none answers, ``route`` returns None,
counts it in ``embedmesh_router_fallback_total`` (by reason) and warns once per outage; the caller then picks from
its own worker pool (round robin over the healthy workers it knows, those the router named before included). That
pool is the one fallback: this client keeps no worker list of its own. A router that failed is skipped for
``retry_after`` seconds, so an outage costs one timeout, not one per request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.logs import get_logger
from embedmesh.core.server import insecure_channel
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.router.metrics import FALLBACKS

__all__ = ["Routes", "RouteClient", "RouteDecision", "CandidateCost", "FALLBACKS"]

log = get_logger(__name__)



@dataclass(frozen=True)
class CandidateCost:
    """One worker the router considered."""

    worker_id: str
    address: str
    overlap_blocks: int
    cost: float
    active_requests: int


@dataclass(frozen=True)
class RouteDecision:
    """Where to send a prompt."""

    worker_id: str
    """Router's worker id."""
    address: str
    """host:port of the chosen WorkerService."""
    overlap_blocks: int = 0
    """Prefix blocks the chosen worker already caches (0 when unknown)."""
    candidates: list[CandidateCost] = field(default_factory=list)
    """Every candidate, cheapest first."""
    adapter_missing: bool = False
    """The request named an adapter no worker holds; the worker was picked by load (load it there first)."""


class Routes(Protocol):
    """What the pipeline asks for a worker: the router service over gRPC (``RouteClient``) or the router in the
    preprocessor's own process (``router/local.py:LocalRouteClient``)."""

    block_size: int

    async def route(self, model: str, hashes: Sequence[int], prompt_tokens: int, request_id: str = "",
                    adapter: str = "") -> RouteDecision | None: ...

    async def close(self) -> None: ...


class RouteClient:
    """Asks the router replicas; None when none answers (see the module docstring)."""

    def __init__(self, routers: Sequence[str], block_size: int, timeout: float = 0.5,
                 retry_after: float = 2.0) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.timeout = timeout
        self.retry_after = retry_after
        self.routers = list(routers)
        self._channels = [insecure_channel(a) for a in self.routers]
        self._stubs = [router_pb2_grpc.RouterServiceStub(c) for c in self._channels]
        self._down_until = [0.0] * len(self._stubs)
        self._next = itertools.count()
        self._warned = False

    async def close(self) -> None:
        for c in self._channels:
            await c.close()

    async def route(self, model: str, hashes: Sequence[int], prompt_tokens: int,
                    request_id: str = "", adapter: str = "") -> RouteDecision | None:
        """The router's choice; None when no router answered (the caller's pool decides). With ``adapter`` (a LoRA
        adapter's name; ``hashes`` its chain) only workers holding it are considered."""
        req = router_pb2.RouteRequest(model=model, block_hashes=hashes, block_size=self.block_size,
                                      prompt_tokens=prompt_tokens, request_id=request_id, lora_adapter=adapter)
        n = len(self._stubs)
        start = next(self._next)
        reason = "no_router"
        now = time.monotonic()
        for i in range(n):
            k = (start + i) % n
            if self._down_until[k] > now:
                reason = "router_down"
                continue
            try:
                resp = await self._stubs[k].Route(req, timeout=self.timeout)
            except grpc.aio.AioRpcError as e:
                err = from_rpc_error(e)
                reason = err.reason.lower()
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    log.warning("router refused the request", extra={"request_id": request_id,
                                                                     "field": err.field, "error": err.message})
                    break  # every replica would say the same
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        and err.reason != "NO_WORKER":
                    self._down_until[k] = time.monotonic() + self.retry_after
                continue
            self._warned = False
            return _decision(resp)
        FALLBACKS.labels(reason).inc()
        if not self._warned:
            self._warned = True
            log.warning("router unavailable; routing round robin", extra={"reason": reason})
        return None


def _decision(resp: router_pb2.RouteResponse) -> RouteDecision:
    return RouteDecision(resp.worker_id, resp.address, resp.overlap_blocks, [
        CandidateCost(c.worker_id, c.address, c.overlap_blocks, c.cost, c.active_requests) for c in resp.candidates],
        adapter_missing=resp.adapter_missing)

"""What the preprocessor calls: ``await client.route(model, hashes, prompt_len)`` -> a ``RouteDecision``, or None.

Router replicas are tried in turn (a different one first each call). When none answers, ``route`` returns None,
counts it in ``embedmesh_router_fallback_total`` (by reason) and warns once per outage; the caller then picks from
its own worker pool (round robin over the healthy workers it knows, those the router named before included). That
pool is the one fallback: this client keeps no worker list of its own. A router that failed is skipped for
``retry_after`` seconds, so an outage costs one timeout, not one per request.

Questions go to each replica over one long-lived ``RouteMany`` stream (``_RouteStream``, on ``core.mux``): a message
on an open stream costs a fraction of a call. A question unanswered within ``timeout`` counts as
DEADLINE_EXCEEDED; a stream that ends fails its open questions (UNAVAILABLE) and the next question opens a new one.
The mesh ships from one version, so every router serves RouteMany: an UNIMPLEMENTED is a failure like any other.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from opentelemetry import propagate

from embedmesh.core.errors import Unavailable, from_rpc_error, rpc_error, rpc_error_from_status, to_status_message
from embedmesh.core.logs import get_logger
from embedmesh.core.mux import MuxSession, entry
from embedmesh.core.server import plain_mesh_channel
from embedmesh.router.v1 import router_pb2
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


ROUTE_MANY = "/embedmesh.router.v1.RouterService/RouteMany"
_QUESTIONS = router_pb2.RouteManyRequest.DESCRIPTOR.fields_by_name["questions"].number
_ENDED = rpc_error_from_status(to_status_message(Unavailable(
    "the router ended its RouteMany stream (it is shutting down)", reason="ROUTER_DRAINING")))


class _RouteStream:
    """Route questions to one replica over its RouteMany stream (opened on first use, re-opened after it ended)."""

    def __init__(self, address: str) -> None:
        self._channel, metadata = plain_mesh_channel(address)
        method = self._channel.stream_stream(ROUTE_MANY, request_serializer=None,
                                             response_deserializer=router_pb2.RouteManyResponse.FromString)
        self._open = lambda: method(metadata=metadata)
        self._session: MuxSession | None = None
        self._waiting: dict[int, asyncio.Future[router_pb2.RouteResponse]] = {}
        self._ids = itertools.count(1)

    async def ask(self, request: router_pb2.RouteRequest, timeout: float) -> router_pb2.RouteResponse:
        """The replica's answer; raises its AioRpcError (DEADLINE_EXCEEDED past ``timeout``)."""
        if self._session is None or self._session.closed:
            self._session = MuxSession(self._open, self._on_message, self._on_end)
        qid = next(self._ids)
        future: asyncio.Future[router_pb2.RouteResponse] = asyncio.get_running_loop().create_future()
        self._waiting[qid] = future
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        self._session.send(entry(_QUESTIONS, router_pb2.RouteQuestion(
            id=qid, request=request, trace_context=carrier).SerializeToString()))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the router did not answer within {timeout:g} s") from None
        finally:
            self._waiting.pop(qid, None)

    def _on_message(self, message: router_pb2.RouteManyResponse) -> None:
        for answer in message.answers:
            future = self._waiting.pop(answer.id, None)
            if future is None or future.done():
                continue
            if answer.WhichOneof("result") == "error":
                future.set_exception(rpc_error_from_status(answer.error))
            else:
                future.set_result(answer.response)

    def _on_end(self, error: grpc.aio.AioRpcError | None) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error or _ENDED)

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        await self._channel.close()


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
        self._streams = [_RouteStream(a) for a in self.routers]
        self._down_until = [0.0] * len(self._streams)
        self._next = itertools.count()
        self._warned = False

    async def close(self) -> None:
        for stream in self._streams:
            await stream.close()

    async def route(self, model: str, hashes: Sequence[int], prompt_tokens: int,
                    request_id: str = "", adapter: str = "") -> RouteDecision | None:
        """The router's choice; None when no router answered (the caller's pool decides). With ``adapter`` (a LoRA
        adapter's name; ``hashes`` its chain) only workers holding it are considered."""
        req = router_pb2.RouteRequest(model=model, block_hashes=hashes, block_size=self.block_size,
                                      prompt_tokens=prompt_tokens, request_id=request_id, lora_adapter=adapter)
        n = len(self._streams)
        start = next(self._next)
        reason = "no_router"
        now = time.monotonic()
        for i in range(n):
            k = (start + i) % n
            if self._down_until[k] > now:
                reason = "router_down"
                continue
            try:
                resp = await self._streams[k].ask(req, self.timeout)
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

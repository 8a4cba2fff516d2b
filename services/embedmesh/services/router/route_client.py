"""What the preprocessor calls: ask a router replica for the worker of a prompt. If no router answers, the caller
falls back to round robin over its healthy workers, and the fallback is counted."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import grpc
from prometheus_client import Counter

from embedmesh.core.errors import EmbedmeshError, from_rpc_error
from embedmesh.core.logs import get_logger
from embedmesh.core.server import insecure_channel
from embedmesh.router.v1 import router_pb2, router_pb2_grpc

__all__ = ["RouteClient", "FALLBACKS"]

log = get_logger(__name__)

FALLBACKS = Counter("embedmesh_router_fallback_total", "Requests routed round robin because no router answered",
                    ["reason"])


class RouteClient:
    def __init__(self, routers: Sequence[str], block_size: int, timeout: float = 0.5) -> None:
        self.block_size = block_size
        self.timeout = timeout
        self._channels = [insecure_channel(a) for a in routers]
        self._stubs = [router_pb2_grpc.RouterServiceStub(c) for c in self._channels]
        self._next = itertools.count()
        self._warned = False

    async def close(self) -> None:
        for c in self._channels:
            await c.close()

    async def route(self, model: str, hashes: list[int], prompt_tokens: int,
                    request_id: str) -> router_pb2.RouteResponse | None:
        """The router's choice, or None when no router could decide (caller falls back)."""
        req = router_pb2.RouteRequest(model=model, block_hashes=hashes, block_size=self.block_size,
                                      prompt_tokens=prompt_tokens, request_id=request_id)
        start = next(self._next)
        last: EmbedmeshError | None = None
        for i in range(len(self._stubs)):
            stub = self._stubs[(start + i) % len(self._stubs)]
            try:
                resp = await stub.Route(req, timeout=self.timeout)
                self._warned = False
                return resp
            except grpc.aio.AioRpcError as e:
                last = from_rpc_error(e)
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    break
        reason = last.reason.lower() if last else "no_router"
        FALLBACKS.labels(reason).inc()
        if not self._warned:
            self._warned = True
            log.warning("router unavailable; routing round robin", extra={"reason": reason})
        return None

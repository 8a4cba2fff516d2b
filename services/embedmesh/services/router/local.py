"""The router inside the preprocessor's process (``--embedded-router``), as Dynamo's frontend holds its KV router.

The same registry, radix index and cost policy as the router service (``router/main.build``), served on the
preprocessor's own port (``RouterService``: workers stream their registrations, loads and KV events to it;
``ListWorkers`` / ``GetIndexStats`` answer there), and asked without a network hop: ``LocalRouteClient.route``
calls the policy directly. It answers exactly what ``RouteClient.route`` answers (a ``RouteDecision``, or None
when no worker of the model is registered, counted in ``embedmesh_router_fallback_total``; the caller's worker pool
then decides), so the pipeline cannot tell them apart.

One preprocessor replica per router: with several preprocessors, each would need every worker's stream (the
separate router service is the layout for that; see README "Fast path").
"""

from __future__ import annotations

from collections.abc import Sequence

from embedmesh.core.errors import EmbedmeshError
from embedmesh.core.logs import get_logger
from embedmesh.services.router.metrics import FALLBACKS
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.route_client import CandidateCost, RouteDecision

__all__ = ["LocalRouteClient"]

log = get_logger(__name__)


class LocalRouteClient:
    """``RouteClient``'s interface over an in-process ``KvRouter``."""

    def __init__(self, router: KvRouter, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.router = router
        self.block_size = block_size
        self._warned = False

    async def close(self) -> None:
        return None

    async def route(self, model: str, hashes: Sequence[int], prompt_tokens: int,
                    request_id: str = "", adapter: str = "") -> RouteDecision | None:
        try:
            d = self.router.route(model, hashes, self.block_size, prompt_tokens, request_id, adapter)
        except EmbedmeshError as err:
            FALLBACKS.labels(err.reason.lower() or "refused").inc()
            if err.reason != "NO_WORKER":
                log.warning("router refused the request", extra={"request_id": request_id, "field": err.field,
                                                                 "error": err.message})
            elif not self._warned:
                self._warned = True
                log.warning("no worker registered with the embedded router yet; routing round robin",
                            extra={"model": model})
            return None
        self._warned = False
        return RouteDecision(d.worker_id, d.address, d.overlap_blocks, [
            CandidateCost(s.worker_id, address, s.overlap, s.cost, s.active) for s, address in d.candidates],
            adapter_missing=d.adapter_missing)

"""Per-tenant admission at the gateway's HTTP protocol (``protocol.py``): a keyed request whose tenant is at its
share is refused from its headers, before any byte of its body is read, any JSON parsed or the app dispatched.

A tenant is admitted while it holds fewer requests in flight than its share (``--tenant-share`` of
``--max-inflight``, or its key's ``max_concurrent_requests`` when lower; the rule of the app's admission,
``app._Admission``) and, when its key has ``requests_per_second``, while its token bucket holds a token (burst
``max(1, rate)``, the rule of ``core.auth.TenantLimiter``). Past either: 429 ``rate_limit_exceeded`` with
``Retry-After``, the same message the app or the preprocessor gives for the same limit. A request is in flight
from the end of its headers to the last byte of its answer (a stream's included).

The app's own admission stays behind this one (for requests this protocol does not see: an ASGI test client, a
pipelined request, which is never answered out of order) and the preprocessor still applies the key's limits;
counted here per gateway process, like the app's share.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from embedmesh.core import auth
from embedmesh.gateway.errors import ApiError

__all__ = ["TenantAdmission"]


class TenantAdmission:
    """The per-tenant counts of one gateway server (every connection of a uvicorn server shares one)."""

    def __init__(self, max_inflight: int, tenant_share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share = max(1, int(max_inflight * tenant_share)) if max_inflight else 0
        self._clock = clock
        self.inflight: dict[str, int] = {}
        self._buckets: dict[str, list[float]] = {}  # tenant -> [tokens, stamp]: bounded by the configured keys

    def cap(self, key: auth.ApiKey) -> int:
        """How many requests the key's tenant may have in flight here; 0 = no bound of its own."""
        caps = [c for c in (self.share, key.max_concurrent_requests) if c]
        return min(caps) if caps else 0

    def refusal(self, key: auth.ApiKey) -> ApiError | None:
        """The 429 a new request of ``key`` gets now, or None when it would be admitted (nothing is taken)."""
        tenant = key.tenant
        held = self.inflight.get(tenant, 0)
        cap = self.cap(key)
        if cap and held >= cap:
            return ApiError(429, f"tenant {tenant!r} has {held} requests in flight at this gateway, its share; "
                                 "retry when one finishes", code="rate_limit_exceeded", type_="rate_limit_error",
                            retry_after=1.0)
        rate = key.requests_per_second
        if rate:
            tokens = self._tokens(key)
            if tokens < 1.0:
                return ApiError(429, f"tenant {tenant!r} is over its {rate:g} requests per second",
                                code="rate_limit_exceeded", type_="rate_limit_error",
                                retry_after=(1.0 - tokens) / rate)
        return None

    def _tokens(self, key: auth.ApiKey) -> float:
        """The tenant's bucket, refilled up to now."""
        now = self._clock()
        burst = max(1.0, key.requests_per_second)
        bucket = self._buckets.get(key.tenant)
        if bucket is None:
            bucket = self._buckets[key.tenant] = [burst, now]
        bucket[0] = min(burst, bucket[0] + (now - bucket[1]) * key.requests_per_second)
        bucket[1] = now
        return bucket[0]

    def enter(self, key: auth.ApiKey) -> ApiError | None:
        """Admit a request of ``key`` (its slot and a token taken: call ``leave`` when it is answered) or return
        its refusal (nothing taken)."""
        err = self.refusal(key)
        if err is not None:
            return err
        if key.requests_per_second:
            self._buckets[key.tenant][0] -= 1.0
        self.inflight[key.tenant] = self.inflight.get(key.tenant, 0) + 1
        return None

    def leave(self, tenant: str) -> None:
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)  # bounded by the tenants with requests in flight

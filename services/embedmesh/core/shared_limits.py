"""Per-tenant limits shared by every replica, in Redis.

``auth.TenantLimiter`` counts in one process: with N preprocessor (or vector store) replicas a tenant got N times
its limits. With ``REDIS_URL`` set, the same three limits of a key — requests in flight, requests per second (token
bucket, burst ``max(1, rate)``) and tokens per minute — are kept in Redis and checked and taken in one Lua script
(atomic, with Redis's own clock, so replicas' clocks do not matter):

    embedmesh:limits:<tenant>:inflight   sorted set of leases (member: a random id, score: when it expires)
    embedmesh:limits:<tenant>:bucket     hash {tokens, stamp}
    embedmesh:limits:<tenant>:tokens     sorted set of charges (member: "<tokens>:<id>", score: when charged)

A request in flight holds a lease until it ends; a replica that dies holding leases loses them when they expire
(``LEASE_SECONDS``, longer than any request may run). Every key expires on its own when a tenant goes quiet.

Redis unreachable or failing: the process falls back to its own ``TenantLimiter`` for that request (per-replica
limits, as without Redis) and says so once in the log — a limit must not turn into an outage.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from embedmesh.core.errors import ResourceExhausted
from embedmesh.core.logs import get_logger

__all__ = ["SharedLimits", "Lease", "LEASE_SECONDS"]

log = get_logger("embedmesh.limits")

LEASE_SECONDS = 3600.0
"""How long a replica's lease outlives it, at most: longer than a request may run (the gateway's deadline is 600 s)."""

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local maxc, rps, tpm, lease = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local n = redis.call('ZCARD', KEYS[1])
  if n >= maxc then return {1, n, 1000} end
end
local tokens = 0
if rps > 0 then
  local burst = math.max(1, rps)
  local b = redis.call('HMGET', KEYS[2], 'tokens', 'stamp')
  tokens = tonumber(b[1]) or burst
  local stamp = tonumber(b[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - stamp) / 1000 * rps)
  if tokens < 1 then return {2, 0, math.ceil((1 - tokens) / rps * 1000)} end
end
if tpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - 60000)
  local used = 0
  for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    used = used + tonumber(string.match(m, '^(%d+):'))
  end
  if used >= tpm then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {3, used, math.max(1, tonumber(first[2]) + 60000 - now)}
  end
end
if rps > 0 then
  redis.call('HSET', KEYS[2], 'tokens', tostring(tokens - 1), 'stamp', tostring(now))
  redis.call('PEXPIRE', KEYS[2], math.ceil(math.max(1, rps) / rps * 1000) + 60000)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], lease)
end
return {0, 0, 0}
"""

_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 61000)
return 1
"""


@dataclass(frozen=True)
class Lease:
    """A request's slot in its tenant's shared in-flight count (``release`` it when the request ends)."""

    tenant: str
    lease_id: str


def _keys(tenant: str) -> list[str]:
    base = f"embedmesh:limits:{tenant}"
    return [f"{base}:inflight", f"{base}:bucket", f"{base}:tokens"]


class SharedLimits:
    """The three per-key limits of ``auth.ApiKey``, counted in Redis for every replica at once."""

    def __init__(self, url: str, timeout: float = 1.0) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self._redis: Any = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._charge = self._redis.register_script(_CHARGE)
        self._warned = False

    def failed(self, e: BaseException) -> None:
        """Note a Redis failure (once in the log): the caller falls back to the process's own limiter."""
        if not self._warned:
            self._warned = True
            log.warning("shared tenant limits unavailable; using this process's own limits",
                        extra={"error": f"{type(e).__name__}: {e}"[:200]})

    async def acquire(self, tenant: str, max_concurrent: int, rps: float, tpm: int) -> Lease | None:
        """Take one request's share of the tenant's limits, or raise ResourceExhausted (what a local refusal
        says, with Redis's wait). A Lease when a slot is held (only with ``max_concurrent``); Redis errors raise
        as they are (the caller falls back)."""
        lease_id = secrets.token_hex(8)
        code, count, wait_ms = await self._acquire(keys=_keys(tenant), args=[
            lease_id, max_concurrent, repr(float(rps)), tpm, int(LEASE_SECONDS * 1000)])
        self._warned = False
        wait = max(int(wait_ms), 1) / 1000
        if code == 1:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {count} requests in flight across the mesh, its limit; retry when one "
                "finishes", reason="RATE_LIMIT_EXCEEDED", retry_after_seconds=wait)
        if code == 2:
            raise ResourceExhausted(f"tenant {tenant!r} is over its {rps:g} requests per second",
                                    reason="RATE_LIMIT_EXCEEDED", retry_after_seconds=wait)
        if code == 3:
            raise ResourceExhausted(f"tenant {tenant!r} is over its {tpm} tokens per minute",
                                    reason="RATE_LIMIT_EXCEEDED", retry_after_seconds=wait)
        return Lease(tenant, lease_id) if max_concurrent else None

    async def release(self, lease: Lease) -> None:
        await self._redis.zrem(_keys(lease.tenant)[0], lease.lease_id)

    async def charge(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` (prompt + completion) against the tenant's tokens per minute, for every replica."""
        await self._charge(keys=[_keys(tenant)[2]], args=[f"{int(tokens)}:{secrets.token_hex(6)}"])

    async def close(self) -> None:
        await self._redis.aclose()

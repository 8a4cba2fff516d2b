"""L1 over optional L2, with single flight.

A get looks in L1, then L2 (a hit there is copied into L1); a put writes both. ``get_or_compute`` makes concurrent
requests for one missing key run the computation once: the others await the same future.

An L2 hit is never meant to be slower than the miss it replaces: for entries ``get_or_compute`` can compute again,
the cache learns per size class whether reading them from Redis beats computing them, and skips the L2 (read and
write) for the classes where it does not (``size_rule``). Plain ``get``/``put`` (client uploads, which cannot be
recomputed) always use it.

L2 is an optimisation, never a dependency: whatever Redis does (gone, hung, full at ``maxmemory``), a get is at worst
a miss and a put at worst an L1-only store; no request fails because of it (see ``redis_tier``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from embedmesh.core.logs import get_logger
from embedmesh.services.encoder_cache.lru import ByteLRU
from embedmesh.services.encoder_cache.metrics import L2_DOWN, LOOKUPS
from embedmesh.services.encoder_cache.redis_tier import RedisTier
from embedmesh.services.encoder_cache.size_rule import SizeRule

__all__ = ["CachedTensor", "TieredCache", "CacheConfig", "DEFAULT_MAX_TTL_SECONDS"]

log = get_logger(__name__)

DEFAULT_MAX_TTL_SECONDS = 30 * 24 * 3600
"""Longest TTL a client may ask for unless ``EMBEDMESH_CACHE_MAX_TTL_SECONDS`` says otherwise."""


def _env_max_ttl() -> int:
    raw = os.environ.get("EMBEDMESH_CACHE_MAX_TTL_SECONDS", "")
    try:
        value = int(raw) if raw else DEFAULT_MAX_TTL_SECONDS
    except ValueError:
        raise ValueError(f"EMBEDMESH_CACHE_MAX_TTL_SECONDS: expected a whole number of seconds, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"EMBEDMESH_CACHE_MAX_TTL_SECONDS: must be >= 1, got {value}")
    return value



@dataclass(frozen=True)
class CachedTensor:
    array: np.ndarray
    dtype: int

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass(frozen=True)
class CacheConfig:
    capacity_bytes: int = 1 << 30
    """L1 capacity in bytes."""
    redis_url: str = ""
    """L2 Redis URL; empty = L1 only (the embedded default)."""
    default_ttl_seconds: int = 3600
    """TTL of entries without their own."""
    max_ttl_seconds: int = field(default_factory=_env_max_ttl)
    """Longest TTL a client may ask for (a longer one is refused, naming ``ttl_seconds``)."""


class TieredCache:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.l1: ByteLRU[CachedTensor] = ByteLRU(config.capacity_bytes)
        self.l2: RedisTier | None = RedisTier(config.redis_url) if config.redis_url else None
        self._inflight: dict[str, asyncio.Future[CachedTensor]] = {}
        self.rule = SizeRule()
        """Per size class, whether the L2 beats computing an entry again (learned; see ``size_rule``)."""
        self.computed = 0
        """How many times get_or_compute ran its function (for tests and metrics)."""

    async def close(self) -> None:
        if self.l2 is not None:
            await self.l2.close()

    def ttl(self, requested: int | None) -> int:
        ttl = requested if requested else self.config.default_ttl_seconds
        return max(1, min(ttl, self.config.max_ttl_seconds))

    async def get(self, key: str) -> CachedTensor | None:
        return (await self._get(key, computable=False))[0]

    async def _get(self, key: str, *, computable: bool) -> tuple[CachedTensor | None, float | None]:
        """The value, and how long the L2 lookup took when there was one (None: L1 hit or no L2)."""
        hit = self.l1.get(key)
        if hit is not None:
            LOOKUPS.labels("l1", "hit").inc()
            return hit, None
        LOOKUPS.labels("l1", "miss").inc()
        if self.l2 is None:
            return None, None
        before = self.l2.counters.unavailable
        skipped = self.l2.counters.skipped
        started = time.perf_counter()
        try:
            got = await self.l2.get(key, self.rule.use_l2 if computable else None)
        except Exception:  # noqa: BLE001 - L2 must never fail a request; RedisTier already catches Redis errors
            log.exception("L2 get failed; treated as a miss")
            got = None
        elapsed = time.perf_counter() - started
        if self.l2.counters.unavailable > before:
            L2_DOWN.inc()
        if got is None:
            LOOKUPS.labels("l2", "skipped" if self.l2.counters.skipped > skipped else "miss").inc()
            return None, elapsed
        LOOKUPS.labels("l2", "hit").inc()
        value = CachedTensor(got[0], got[1])
        self.rule.record_l2(value.nbytes, elapsed)
        self.l1.put(key, value, value.nbytes, self.config.default_ttl_seconds)
        return value, elapsed

    async def put(self, key: str, value: CachedTensor, ttl_seconds: int | None = None) -> bool:
        """Store in every tier; True when at least one tier kept it."""
        return await self._put(key, value, ttl_seconds, computable=False)

    async def _put(self, key: str, value: CachedTensor, ttl_seconds: int | None, *, computable: bool) -> bool:
        ttl = self.ttl(ttl_seconds)
        stored = self.l1.put(key, value, value.nbytes, ttl)
        if self.l2 is not None and (not computable or self.rule.use_l2(value.nbytes)):
            before = self.l2.counters.unavailable
            try:
                stored = await self.l2.put(key, value.array, value.dtype, ttl) or stored
            except Exception:  # noqa: BLE001 - see get
                log.exception("L2 put failed; stored in L1 only")
            if self.l2.counters.unavailable > before:
                L2_DOWN.inc()
        return stored

    async def contains(self, key: str) -> bool:
        if key in self.l1:
            return True
        if self.l2 is None:
            return False
        try:
            return await self.l2.contains(key)
        except Exception:  # noqa: BLE001 - see get
            log.exception("L2 contains failed; treated as absent")
            return False

    async def delete(self, key: str) -> bool:
        found = self.l1.delete(key)
        if self.l2 is not None:
            try:
                found = await self.l2.delete(key) or found
            except Exception:  # noqa: BLE001 - see get
                log.exception("L2 delete failed")
        return found

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[CachedTensor]],
                             ttl_seconds: int | None = None) -> CachedTensor:
        """The cached value, or ``compute()`` run once however many callers ask at the same time. The L2 is used
        for sizes where reading from it has been faster than ``compute()`` (see ``size_rule``)."""
        hit, lookup_seconds = await self._get(key, computable=True)
        if hit is not None:
            return hit
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[CachedTensor] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            self.computed += 1
            started = time.perf_counter()
            value = await compute()
            self.rule.record_compute(value.nbytes, time.perf_counter() - started)
            if lookup_seconds is not None:
                self.rule.record_lookup(value.nbytes, lookup_seconds)
            await self._put(key, value, ttl_seconds, computable=True)
            future.set_result(value)
            return value
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            del self._inflight[key]

    def expires_at(self, ttl_seconds: int | None) -> int:
        return int(time.time()) + self.ttl(ttl_seconds)

"""L1 over optional L2, with single flight.

A get looks in L1, then L2 (a hit there is copied into L1); a put writes both. ``get_or_compute`` makes concurrent
requests for one missing key run the computation once: the others await the same future.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter

from embedmesh.services.encoder_cache.lru import ByteLRU
from embedmesh.services.encoder_cache.redis_tier import RedisTier

__all__ = ["CachedTensor", "TieredCache", "CacheConfig"]

LOOKUPS = Counter("embedmesh_encoder_cache_lookups_total", "Cache lookups by tier and result", ["tier", "result"])
L2_DOWN = Counter("embedmesh_encoder_cache_l2_unavailable_total", "L2 operations skipped because Redis was away")


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
    max_ttl_seconds: int = 7 * 24 * 3600
    """Longest TTL a client may ask for."""


class TieredCache:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.l1: ByteLRU[CachedTensor] = ByteLRU(config.capacity_bytes)
        self.l2: RedisTier | None = RedisTier(config.redis_url) if config.redis_url else None
        self._inflight: dict[str, asyncio.Future[CachedTensor]] = {}
        self.computed = 0
        """How many times get_or_compute ran its function (for tests and metrics)."""

    async def close(self) -> None:
        if self.l2 is not None:
            await self.l2.close()

    def ttl(self, requested: int | None) -> int:
        ttl = requested if requested else self.config.default_ttl_seconds
        return max(1, min(ttl, self.config.max_ttl_seconds))

    async def get(self, key: str) -> CachedTensor | None:
        hit = self.l1.get(key)
        if hit is not None:
            LOOKUPS.labels("l1", "hit").inc()
            return hit
        LOOKUPS.labels("l1", "miss").inc()
        if self.l2 is None:
            return None
        before = self.l2.counters.unavailable
        got = await self.l2.get(key)
        if self.l2.counters.unavailable > before:
            L2_DOWN.inc()
        if got is None:
            LOOKUPS.labels("l2", "miss").inc()
            return None
        LOOKUPS.labels("l2", "hit").inc()
        value = CachedTensor(got[0], got[1])
        self.l1.put(key, value, value.nbytes, self.config.default_ttl_seconds)
        return value

    async def put(self, key: str, value: CachedTensor, ttl_seconds: int | None = None) -> bool:
        """Store in every tier; True when at least one tier kept it."""
        ttl = self.ttl(ttl_seconds)
        stored = self.l1.put(key, value, value.nbytes, ttl)
        if self.l2 is not None:
            before = self.l2.counters.unavailable
            stored = await self.l2.put(key, value.array, value.dtype, ttl) or stored
            if self.l2.counters.unavailable > before:
                L2_DOWN.inc()
        return stored

    async def contains(self, key: str) -> bool:
        if key in self.l1:
            return True
        return bool(self.l2 and await self.l2.contains(key))

    async def delete(self, key: str) -> bool:
        found = self.l1.delete(key)
        if self.l2 is not None:
            found = await self.l2.delete(key) or found
        return found

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[CachedTensor]],
                             ttl_seconds: int | None = None) -> CachedTensor:
        """The cached value, or ``compute()`` run once however many callers ask at the same time."""
        hit = await self.get(key)
        if hit is not None:
            return hit
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[CachedTensor] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            self.computed += 1
            value = await compute()
            await self.put(key, value, ttl_seconds)
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

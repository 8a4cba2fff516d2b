"""TieredCache over a real redis-server: chunked round trips, TTL, corruption and truncation detected, Redis going
away and coming back, single flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from embedmesh.core.tensors import f32_to_bf16
from embedmesh.services.encoder_cache.tiered import CacheConfig, CachedTensor, TieredCache
from embedmesh.tensor.v1 import tensor_pb2 as tpb
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.close()


@pytest.fixture
async def cache(server: RedisServer) -> AsyncIterator[TieredCache]:
    if server.proc is None:
        server.start()
    redis.Redis.from_url(server.url).flushall()
    c = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=server.url))
    yield c
    await c.close()


def tensor(rows: int, cols: int = 576, seed: int = 0) -> CachedTensor:
    return CachedTensor(np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32), tpb.DATA_TYPE_FP32)


@pytest.mark.parametrize("rows", [1, 455, 9000])  # ~2 KiB, ~1 MiB, ~20 MiB: one chunk, boundary, many chunks
async def test_l2_round_trip_through_a_fresh_l1(server: RedisServer, cache: TieredCache, rows: int) -> None:
    t = tensor(rows)
    assert await cache.put("k", t)
    other = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=server.url))  # another replica
    got = await other.get("k")
    await other.close()
    assert got is not None and got.dtype == t.dtype and np.array_equal(got.array, t.array)
    assert other.l2 is not None and other.l2.counters.hits == 1


async def test_bf16_round_trip(server: RedisServer, cache: TieredCache) -> None:
    bits = f32_to_bf16(np.linspace(-3, 3, 576 * 4, dtype=np.float32).reshape(4, 576))
    await cache.put("b", CachedTensor(bits, tpb.DATA_TYPE_BF16))
    cache.l1.delete("b")
    got = await cache.get("b")
    assert got is not None and got.dtype == tpb.DATA_TYPE_BF16 and np.array_equal(got.array, bits)


async def test_values_are_chunked_not_one_giant_string(server: RedisServer, cache: TieredCache) -> None:
    await cache.put("big", tensor(9000))
    r = redis.Redis.from_url(server.url)
    chunk_keys = r.keys("embedmesh:cache:big:c*")
    assert len(chunk_keys) == 20
    assert max(r.strlen(k) for k in chunk_keys) <= 1 << 20


async def test_ttl_expiry(server: RedisServer, cache: TieredCache) -> None:
    await cache.put("short", tensor(2), ttl_seconds=1)
    cache.l1.delete("short")
    assert await cache.contains("short")
    time.sleep(1.6)
    assert await cache.get("short") is None


@pytest.mark.parametrize("damage", ["flip a byte", "drop a chunk", "truncate a chunk", "garbage header"])
async def test_damaged_values_are_misses_never_served(server: RedisServer, cache: TieredCache, damage: str) -> None:
    await cache.put("d", tensor(900))
    cache.l1.delete("d")
    r = redis.Redis.from_url(server.url)
    if damage == "flip a byte":
        c = bytearray(r.get("embedmesh:cache:d:c1"))
        c[100] ^= 0xFF
        r.set("embedmesh:cache:d:c1", bytes(c))
    elif damage == "drop a chunk":
        r.delete("embedmesh:cache:d:c0")
    elif damage == "truncate a chunk":
        r.set("embedmesh:cache:d:c1", r.get("embedmesh:cache:d:c1")[:-7])
    else:
        r.set("embedmesh:cache:d:h", b"not a header")
    assert await cache.get("d") is None
    assert cache.l2 is not None and cache.l2.counters.corrupted == 1
    assert not r.exists("embedmesh:cache:d:h"), "a damaged value is removed"


async def test_redis_restart_mid_run(server: RedisServer, cache: TieredCache, caplog: Any) -> None:
    await cache.put("before", tensor(3))
    server.stop()
    # Redis is gone: requests still succeed from L1, nothing hangs, the outage is counted and logged once.
    assert (await cache.get("before")) is not None
    assert await cache.put("during", tensor(3, seed=1))
    for i in range(5):
        assert await cache.get(f"missing-{i}") is None
    assert cache.l2 is not None and not cache.l2.available and cache.l2.counters.unavailable >= 1
    warnings = [r for r in caplog.records if "redis unavailable" in r.getMessage()]
    assert len(warnings) == 1
    server.start()
    await asyncio.sleep(1.1)  # past the retry interval
    assert await cache.put("after", tensor(3, seed=2))
    assert cache.l2.available
    cache.l1.delete("after")
    got = await cache.get("after")
    assert got is not None and np.array_equal(got.array, tensor(3, seed=2).array)


async def test_single_flight_computes_once(cache: TieredCache) -> None:
    calls = 0

    async def compute() -> CachedTensor:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return tensor(4)

    results = await asyncio.gather(*[cache.get_or_compute("sf", compute) for _ in range(20)])
    assert calls == 1
    assert all(np.array_equal(r.array, results[0].array) for r in results)
    assert (await cache.get_or_compute("sf", compute)) is not None and calls == 1


async def test_single_flight_error_reaches_every_waiter_and_is_not_cached(cache: TieredCache) -> None:
    async def boom() -> CachedTensor:
        await asyncio.sleep(0.02)
        raise ValueError("bad payload")

    results = await asyncio.gather(*[cache.get_or_compute("err", boom) for _ in range(5)], return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)
    assert await cache.get("err") is None

"""TieredCache over a real redis-server: chunked round trips, TTL, corruption and truncation detected, entries
planted or moved by someone with write access to Redis refused (integrity digest keyed with the mesh token), Redis
going away and coming back, Redis full at maxmemory, single flight, and the size rule: sizes where the L2 loses to
computing skip it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from embedmesh.core.tensors import f32_to_bf16
from embedmesh.services.encoder_cache.keys import payload_key, tenant_key
from embedmesh.services.encoder_cache.redis_tier import RedisTier
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
    assert not r.keys("embedmesh:cache:d:c*"), "with its chunks"


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


def _copy_entry(r: redis.Redis, src: str, dst: str) -> None:
    for k in r.keys(f"embedmesh:cache:{src}:*"):
        suffix = k.decode().rsplit(":", 1)[1]
        r.set(f"embedmesh:cache:{dst}:{suffix}", r.get(k))


@pytest.fixture
async def keyed(server: RedisServer) -> AsyncIterator[TieredCache]:
    """A cache whose L2 digests are keyed with a mesh token, as in a mesh run with EMBEDMESH_MESH_TOKEN."""
    if server.proc is None:
        server.start()
    redis.Redis.from_url(server.url).flushall()
    c = TieredCache(CacheConfig(capacity_bytes=64 << 20))
    c.l2 = RedisTier(server.url, mesh_token="mesh-secret-for-tests")
    yield c
    await c.close()


async def test_entry_moved_to_a_validated_key_is_refused(server: RedisServer, keyed: TieredCache) -> None:
    """A client's upload copied (by someone with Redis write access) under a server-validated key is never served:
    the key is part of the digest."""
    upload = tenant_key("alice", "emb-" + "1" * 32)
    target = payload_key("payload:1:576", b"the victim's payload")
    poison = np.full((4, 576), 1e30, np.float32)
    assert await keyed.put(upload, CachedTensor(poison, tpb.DATA_TYPE_FP32))
    _copy_entry(redis.Redis.from_url(server.url), upload, target)
    assert await keyed.get(target) is None
    assert keyed.l2 is not None and keyed.l2.counters.corrupted == 1 and keyed.l2.counters.hits == 0
    assert not redis.Redis.from_url(server.url).exists(f"embedmesh:cache:{target}:h"), "the planted entry is gone"
    keyed.l1.delete(upload)
    got = await keyed.get(upload)
    assert got is not None and np.array_equal(got.array, poison), "the original stays valid where it was put"


async def test_entry_planted_without_the_mesh_token_is_refused(server: RedisServer, keyed: TieredCache) -> None:
    """Someone who can write to Redis but does not hold the mesh token writes a complete, self-consistent entry
    (digest computed exactly as the server does, with another key or none): a miss, counted, removed."""
    target = payload_key("payload:1:576", b"the victim's payload")
    rows = np.zeros((2, 576), np.float32)
    for attacker_token in ("", "a-guess"):
        forger = RedisTier(server.url, mesh_token=attacker_token)
        assert await forger.put(target, rows, tpb.DATA_TYPE_FP32, 60)
        await forger.close()
        assert redis.Redis.from_url(server.url).exists(f"embedmesh:cache:{target}:h")
        assert await keyed.get(target) is None
    assert keyed.l2 is not None and keyed.l2.counters.corrupted == 2
    # The mesh's own writes, with the token, are served (positive control).
    assert await keyed.put(target, CachedTensor(rows, tpb.DATA_TYPE_FP32))
    keyed.l1.delete(target)
    got = await keyed.get(target)
    assert got is not None and np.array_equal(got.array, rows) and keyed.l2.counters.hits == 1


async def test_header_claiming_another_shape_is_refused(server: RedisServer, cache: TieredCache) -> None:
    """Without a token the digest still binds dtype and shape: a header rewritten to reinterpret the bytes (same
    byte count, other shape) is a miss, not a (576, 2) view of (2, 576) rows."""
    await cache.put("s", tensor(2))
    cache.l1.delete("s")
    r = redis.Redis.from_url(server.url)
    h = bytearray(r.get("embedmesh:cache:s:h"))
    h[12:20], h[20:28] = h[20:28], h[12:20]  # swap the two dimensions
    r.set("embedmesh:cache:s:h", bytes(h))
    assert await cache.get("s") is None
    assert cache.l2 is not None and cache.l2.counters.corrupted == 1


async def test_redis_at_maxmemory_keeps_serving(cache: TieredCache) -> None:
    """Redis full with noeviction refuses writes with OOM: puts still succeed (L1), gets still work, nothing raises,
    Redis is not marked down; once there is room again, L2 stores again."""
    full = RedisServer(maxmemory="1mb").start()
    try:
        admin = redis.Redis.from_url(full.url)
        admin.config_set("maxmemory-policy", "noeviction")
        c = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=full.url))
        assert c.l2 is not None
        for i in range(8):  # ~0.5 MiB each: Redis fills up after a couple
            assert await c.put(f"k{i}", tensor(230, seed=i))
        assert c.l2.counters.rejected >= 1, "Redis refused writes at maxmemory"
        assert c.l2.available, "a refusal is not an outage"
        for i in range(8):
            got = await c.get(f"k{i}")
            assert got is not None and np.array_equal(got.array, tensor(230, seed=i).array)
        assert (await c.get("never-stored")) is None
        admin.config_set("maxmemory", "64mb")
        assert await c.put("after-room", tensor(3))
        c.l1.delete("after-room")
        assert (await c.get("after-room")) is not None and c.l2.counters.hits >= 1
        await c.close()
    finally:
        full.close()


async def test_hung_redis_is_skipped_not_waited_on(server: RedisServer, cache: TieredCache) -> None:
    """A Redis that accepts connections but never answers (SIGSTOP) costs one timeout, then calls skip L2 at once
    until a probe succeeds; it is used again after SIGCONT."""
    import os
    import signal

    assert await cache.put("h", tensor(2))
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert await cache.put("h2", tensor(2, seed=3))  # times out in L2, stored in L1
        assert cache.l2 is not None and not cache.l2.available
        down = cache.l2.counters.unavailable
        for i in range(20):
            assert await cache.get(f"absent-{i}") is None
        assert cache.l2.counters.unavailable >= down + 19, "calls during the outage skip L2 instead of waiting"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    for _ in range(100):
        await asyncio.sleep(0.1)
        if await cache.put("h3", tensor(2, seed=4)) and cache.l2.available:
            break
    assert cache.l2.available
    cache.l1.delete("h3")
    assert (await cache.get("h3")) is not None


PREFIX = "embedmesh:cache:"
FP32 = tpb.DATA_TYPE_FP32


@pytest.fixture
def r(server: RedisServer) -> redis.Redis:
    if server.proc is None:
        server.start()
    client = redis.Redis.from_url(server.url)
    client.flushall()
    return client


def float_rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 576), dtype=np.float32)


# -- the size rule in the cache: where an L2 read loses to computing, it is skipped ----------------------------


def skip_size(cache: TieredCache, nbytes: int) -> None:
    """Teach the cache's rule that, at this size, an L2 hit is much slower than computing."""
    for _ in range(cache.rule.min_samples):
        cache.rule.record_l2(nbytes, 1.0)
        cache.rule.record_compute(nbytes, 1e-6)


async def test_size_rule_skips_l2_where_it_loses(server: RedisServer, r: redis.Redis) -> None:
    value = CachedTensor(float_rows(455), FP32)  # ~1 MiB
    writer = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=server.url))
    assert await writer.put("there", value)  # an entry another replica stored
    await writer.close()

    cache = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=server.url))
    skip_size(cache, value.nbytes)
    calls = 0

    async def compute() -> CachedTensor:
        nonlocal calls
        calls += 1
        return value

    got = await cache.get_or_compute("there", compute)
    assert calls == 1, "the entry is in Redis, but reading it loses to computing: computed"
    assert cache.l2 is not None and cache.l2.counters.hits == 0 and cache.l2.counters.skipped == 1
    assert cache.l2.counters.corrupted == 0 and r.exists(f"{PREFIX}there:h"), "declined, not dropped"
    assert np.array_equal(got.array, value.array)

    await cache.get_or_compute("new", compute)
    assert calls == 2 and not r.exists(f"{PREFIX}new:h"), "nor is it written to Redis"
    assert "new" in cache.l1, "L1 still holds it"

    small = CachedTensor(float_rows(3), FP32)  # another size class: not affected
    await cache.get_or_compute("small", lambda: asyncio.sleep(0, small))
    assert r.exists(f"{PREFIX}small:h")

    cache.l1.delete("there")
    upload = await cache.get("there")  # plain get/put (uploads, nothing to recompute from) always use L2
    assert upload is not None and cache.l2.counters.hits == 1
    assert await cache.put("upload", value) and r.exists(f"{PREFIX}upload:h")
    await cache.close()


async def test_size_rule_learns_from_timings(server: RedisServer, r: redis.Redis) -> None:
    """Slow computations: the L2 stays in use. A slow L2 (here: 50 ms added to every hit): skipped once measured."""
    cache = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=server.url))
    assert cache.l2 is not None
    n = cache.rule.min_samples

    async def slow_compute(i: int) -> CachedTensor:
        await asyncio.sleep(0.05)
        return CachedTensor(float_rows(64, seed=i), FP32)

    for _ in range(2):  # first round: misses (computed and stored), second: L2 hits after L1 lost them
        for i in range(n):
            cache.l1.delete(f"s{i}")
            await cache.get_or_compute(f"s{i}", lambda i=i: slow_compute(i))
    assert cache.rule.use_l2(64 * 576 * 4) and cache.l2.counters.hits == n

    slow_tier_get = cache.l2.get

    async def slow_get(*a: Any, **kw: Any) -> Any:
        got = await slow_tier_get(*a, **kw)
        if got is not None:
            await asyncio.sleep(0.05)
        return got

    cache.l2.get = slow_get  # type: ignore[method-assign]
    ready = {i: CachedTensor(float_rows(2000, seed=i), FP32) for i in range(n)}

    async def fast_compute(i: int) -> CachedTensor:
        return ready[i]

    for _ in range(2):
        for i in range(n):
            cache.l1.delete(f"f{i}")
            await cache.get_or_compute(f"f{i}", lambda i=i: fast_compute(i))
    assert not cache.rule.use_l2(2000 * 576 * 4)
    hits, computed = cache.l2.counters.hits, cache.computed
    cache.l1.delete("f0")
    await cache.get_or_compute("f0", lambda: fast_compute(0))
    assert cache.computed == computed + 1 and cache.l2.counters.hits == hits, "skipped now: computed again"
    await cache.close()

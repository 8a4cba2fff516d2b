"""encoder_cache.redis_tier: the L2's transfer (the lean RESP client reading chunks straight into the result array,
redis-py for other URLs) over a real redis-server: round trips on both transports, damage anywhere is a miss, a
cancelled read leaves nothing behind, AUTH and SELECT."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from embedmesh.services.encoder_cache.redis_tier import RedisTier
from embedmesh.services.encoder_cache.resp import plain_params
from embedmesh.services.encoder_cache.tiered import CacheConfig, CachedTensor, TieredCache
from embedmesh.tensor.v1 import tensor_pb2 as tpb
from tests.support.redis_server import RedisServer

PREFIX = "embedmesh:cache:"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.close()


@pytest.fixture
def r(server: RedisServer) -> redis.Redis:
    if server.proc is None:
        server.start()
    client = redis.Redis.from_url(server.url)
    client.flushall()
    return client


def tier_for(url: str, transport: str, **kw: Any) -> RedisTier:
    t = RedisTier(url, **kw)
    if transport == "redis-py":
        t._pool = None  # what a URL the lean client does not serve (TLS, RESP3) gets
    return t


@pytest.fixture(params=["resp", "redis-py"])
async def tier(request: Any, server: RedisServer, r: redis.Redis) -> AsyncIterator[RedisTier]:
    t = tier_for(server.url, request.param)
    yield t
    await t.close()


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 576), dtype=np.float32)


FP32 = tpb.DATA_TYPE_FP32


# empty, 2 KiB, 225 KiB (read whole with the header), 270 KiB (the rest of the chunk in a second read), ~1 MiB, just
# over 1 MiB, 4 MiB, 20 MiB
@pytest.mark.parametrize("n", [0, 1, 100, 120, 455, 456, 1820, 9000])
async def test_round_trip(tier: RedisTier, n: int) -> None:
    a = rows(n, seed=n)
    assert await tier.put("k", a, FP32, 60)
    got = await tier.get("k")
    assert got is not None and got[1] == FP32 and got[0].shape == a.shape and np.array_equal(got[0], a)
    assert not got[0].flags.writeable, "cached rows are shared: read-only"
    assert tier.counters.hits == 1 and tier.counters.corrupted == 0


async def test_both_transports_read_each_others_entries(server: RedisServer, r: redis.Redis) -> None:
    fast, slow = tier_for(server.url, "resp"), tier_for(server.url, "redis-py")
    a, b = rows(1000, 1), rows(1000, 2)
    assert await fast.put("a", a, FP32, 60) and await slow.put("b", b, FP32, 60)
    got_a, got_b = await slow.get("a"), await fast.get("b")
    assert got_a is not None and np.array_equal(got_a[0], a)
    assert got_b is not None and np.array_equal(got_b[0], b)
    await fast.close()
    await slow.close()


@pytest.mark.parametrize("damage", ["flip a byte in the last chunk", "flip a byte late in the first chunk",
                                    "drop the last chunk", "truncate the last chunk", "extend the first chunk",
                                    "first chunk of another type", "garbage header", "huge value under the header key",
                                    "header of another entry"])
async def test_damaged_entry_is_a_miss_and_removed(tier: RedisTier, r: redis.Redis, damage: str) -> None:
    assert await tier.put("d", rows(1000), FP32, 60)  # 3 chunks: the last one is read in the second round trip
    assert await tier.put("other", rows(1000, seed=9), FP32, 60)
    last = f"{PREFIX}d:c2"
    if damage == "flip a byte in the last chunk":
        c = bytearray(r.get(last))
        c[-1] ^= 0x01
        r.set(last, bytes(c))
    elif damage == "flip a byte late in the first chunk":
        c = bytearray(r.get(f"{PREFIX}d:c0"))
        c[900_000] ^= 0x01
        r.set(f"{PREFIX}d:c0", bytes(c))
    elif damage == "first chunk of another type":
        r.delete(f"{PREFIX}d:c0")
        r.rpush(f"{PREFIX}d:c0", b"x")
    elif damage == "drop the last chunk":
        r.delete(last)
    elif damage == "truncate the last chunk":
        r.set(last, r.get(last)[:-4])
    elif damage == "extend the first chunk":
        r.set(f"{PREFIX}d:c0", r.get(f"{PREFIX}d:c0") + b"\0\0\0\0")
    elif damage == "garbage header":
        r.set(f"{PREFIX}d:h", b"EMC2 but not a header")
    elif damage == "huge value under the header key":
        r.set(f"{PREFIX}d:h", b"x" * (3 << 20))
    else:
        r.set(f"{PREFIX}d:h", r.get(f"{PREFIX}other:h"))
    assert await tier.get("d") is None
    assert tier.counters.corrupted == 1 and tier.counters.hits == 0
    assert not r.exists(f"{PREFIX}d:h") and not r.keys(f"{PREFIX}d:c*"), "a damaged entry is removed"
    got = await tier.get("other")  # the connection that read the damage is still good (or replaced)
    assert got is not None and np.array_equal(got[0], rows(1000, seed=9)) and tier.counters.hits == 1


async def test_corrupted_entry_is_computed_again_not_served(server: RedisServer, r: redis.Redis) -> None:
    cache = TieredCache(CacheConfig(capacity_bytes=64 << 20, redis_url=server.url))
    good = CachedTensor(rows(600), FP32)
    assert await cache.put("p", CachedTensor(rows(600, seed=5), FP32))  # what another replica wrote
    c = bytearray(r.get(f"{PREFIX}p:c1"))
    c[10] ^= 0x80
    r.set(f"{PREFIX}p:c1", bytes(c))
    cache.l1.delete("p")
    calls = 0

    async def compute() -> CachedTensor:
        nonlocal calls
        calls += 1
        return good

    got = await cache.get_or_compute("p", compute)
    assert calls == 1 and np.array_equal(got.array, good.array)
    assert cache.l2 is not None and cache.l2.counters.corrupted == 1 and cache.l2.counters.hits == 0
    await cache.close()


async def test_cancelled_read_leaves_the_pool_usable(server: RedisServer, r: redis.Redis) -> None:
    tier = tier_for(server.url, "resp")
    big = rows(9000)
    assert await tier.put("big", big, FP32, 60)
    for delay in (0, 0.0005, 0.002):
        task = asyncio.create_task(tier.get("big"))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    got = await tier.get("big")
    assert got is not None and np.array_equal(got[0], big)
    assert tier.available and tier.counters.corrupted == 0
    await tier.close()


async def test_concurrent_reads_and_writes(server: RedisServer, r: redis.Redis) -> None:
    tier = tier_for(server.url, "resp")
    values = {f"k{i}": rows(50 + 97 * i, seed=i) for i in range(12)}
    assert all(await asyncio.gather(*[tier.put(k, v, FP32, 60) for k, v in values.items()]))
    got = await asyncio.gather(*[tier.get(k) for k in list(values) * 2])
    for k, g in zip(list(values) * 2, got, strict=True):
        assert g is not None and np.array_equal(g[0], values[k])
    await tier.close()


async def test_password_and_database_from_the_url() -> None:
    s = RedisServer().start()
    try:
        admin = redis.Redis.from_url(s.url)
        admin.config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{s.port}/3"
        assert plain_params(url) is not None
        tier = RedisTier(url)
        a = rows(700)
        assert await tier.put("k", a, FP32, 60)
        got = await tier.get("k")
        assert got is not None and np.array_equal(got[0], a)
        authed = redis.Redis(port=s.port, password="s3cret", db=3)
        assert authed.exists(f"{PREFIX}k:h") and not redis.Redis(port=s.port, password="s3cret").exists(
            f"{PREFIX}k:h"), "written to the URL's database"
        await tier.close()
        wrong = RedisTier(f"redis://:nope@127.0.0.1:{s.port}/3")
        assert not await wrong.put("k2", a, FP32, 60) and await wrong.get("k") is None
        assert not wrong.available, "a refused AUTH means L2 cannot be used: down, not an exception"
        await wrong.close()
    finally:
        s.close()


async def test_an_answered_maxmemory_after_an_outage_marks_l2_available_again(tier: RedisTier) -> None:
    """While Redis is down, the call that finds the probe due is the probe. A Stats poller's ``maxmemory`` can be
    that call: when Redis answers it, L2 is up again (it used to take the probe's turn and leave L2 reported away,
    however long Redis had been back, until a request happened to probe first)."""
    tier._down(OSError("redis went away"))
    assert not tier.available
    tier._next_probe = 0.0  # the probe is due
    assert await tier.maxmemory() >= 0
    assert tier.available

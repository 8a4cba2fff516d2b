"""encoder_cache.resp: the lean RESP2 client against a real redis-server — pipelined calls answer one reply per
command in order, error replies come back as redis-py's exception values on a connection that stays usable, a bulk
string is written straight into the sink it was given (or discarded, or collected), long arguments are sent from
the caller's memory, a dead server or a missed deadline raises and closes the connection, AUTH and SELECT at open,
the pool reuses connections and caps them; and which URLs this client serves."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis
from redis import exceptions

from embedmesh.services.encoder_cache.resp import DISCARD, FILLED, RespConnection, RespPool, _encode, plain_params
from tests.support.redis_server import RedisServer

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.close()


@pytest.fixture
async def conn(server: RedisServer) -> AsyncIterator[RespConnection]:
    redis.Redis.from_url(server.url).flushall()
    c = await RespConnection.open(plain_params(server.url), TIMEOUT)  # type: ignore[arg-type]
    yield c
    c.close()


async def test_pipelined_commands_answer_in_order(conn: RespConnection) -> None:
    replies = await conn.call([["SET", "a", "1"], ["INCRBY", "a", 41], ["GET", "a"], ["GET", "missing"],
                               ["RPUSH", "l", "x", "y"], ["LRANGE", "l", 0, -1]], timeout=TIMEOUT)
    assert replies == ["OK", 42, b"42", None, 2, [b"x", b"y"]]


async def test_error_replies_are_values_and_the_connection_stays_usable(conn: RespConnection) -> None:
    await conn.call([["SET", "s", "text"]], timeout=TIMEOUT)
    replies = await conn.call([["INCR", "s"], ["NOSUCHCOMMAND"], ["GET", "s"]], timeout=TIMEOUT)
    assert isinstance(replies[0], exceptions.ResponseError) and "not an integer" in str(replies[0])
    assert isinstance(replies[1], exceptions.ResponseError) and "unknown command" in str(replies[1]).lower()
    assert replies[2] == b"text"
    assert conn.usable and await conn.call([["PING"]], timeout=TIMEOUT) == ["PONG"]


async def test_bulk_strings_go_into_their_sink_discarded_or_collected(conn: RespConnection) -> None:
    big = np.random.default_rng(0).standard_normal(300_000, dtype=np.float32)  # 1.2 MB: above the inline size
    payload = big.tobytes()
    small = b"tiny"
    await conn.call([["SET", "big", memoryview(payload)], ["SET", "small", small]], timeout=TIMEOUT)
    out = np.zeros_like(big)
    asked: list[tuple[int, int]] = []
    seen: list[tuple[int, Any]] = []

    def sink_for(index: int, length: int) -> Any:
        asked.append((index, length))
        return memoryview(out).cast("B") if index == 0 else (DISCARD if index == 1 else None)

    replies = await conn.call([["GET", "big"], ["GET", "big"], ["GET", "small"], ["GET", "nope"]], timeout=TIMEOUT,
                              sink_for=sink_for, on_bulk=lambda i, v: seen.append((i, v)))
    assert replies == [FILLED, DISCARD, small, None]
    assert np.array_equal(out, big), "the body was written into the caller's array"
    assert asked == [(0, len(payload)), (1, len(payload)), (2, len(small))]
    assert seen == [(0, FILLED), (1, DISCARD), (2, small), (3, None)]
    assert conn.usable


def test_long_arguments_are_not_copied_into_the_request() -> None:
    long = memoryview(bytes(100_000))
    pieces = _encode([["SET", "k", long], ["GET", "k"]])
    assert any(p is long for p in pieces), "the long value is sent from the caller's memory"
    assert b"".join(bytes(p) for p in pieces) == (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100000\r\n" + bytes(100_000)
                                                  + b"\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
    assert _encode([["INCRBY", "k", 7]]) == [b"*3\r\n$6\r\nINCRBY\r\n$1\r\nk\r\n$1\r\n7\r\n"]


async def test_a_missed_deadline_raises_and_closes_the_connection(conn: RespConnection) -> None:
    with pytest.raises(TimeoutError, match="did not answer"):
        await conn.call([["BLPOP", "never-pushed", 5]], timeout=0.2)
    assert not conn.usable


async def test_a_cancelled_call_closes_the_connection(conn: RespConnection) -> None:
    task = asyncio.create_task(conn.call([["BLPOP", "never-pushed", 5]], timeout=TIMEOUT))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not conn.usable, "a half-read reply must never be read by the next call"


async def test_a_closed_port_is_a_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(exceptions.ConnectionError, match="cannot connect to redis"):
        await RespConnection.open({"host": "127.0.0.1", "port": port}, TIMEOUT)


async def test_auth_and_select_at_open() -> None:
    s = RedisServer().start()
    try:
        redis.Redis.from_url(s.url).config_set("requirepass", "pw-123")
        c = await RespConnection.open(plain_params(f"redis://:pw-123@127.0.0.1:{s.port}/2"), TIMEOUT)  # type: ignore[arg-type]
        assert await c.call([["SET", "k", "v"]], timeout=TIMEOUT) == ["OK"]
        c.close()
        assert redis.Redis(port=s.port, password="pw-123", db=2).get("k") == b"v"
        assert redis.Redis(port=s.port, password="pw-123", db=0).get("k") is None
        with pytest.raises(exceptions.AuthenticationError, match="refused the connection setup"):
            await RespConnection.open(plain_params(f"redis://:wrong@127.0.0.1:{s.port}/2"), TIMEOUT)  # type: ignore[arg-type]
    finally:
        s.close()


async def test_pool_reuses_connections_and_caps_them(server: RedisServer) -> None:
    pool = RespPool(plain_params(server.url), TIMEOUT, max_connections=2)  # type: ignore[arg-type]
    a = await pool.acquire()
    pool.release(a)
    assert await pool.acquire() is a, "an idle connection is reused"
    b = await pool.acquire()
    assert b is not a
    third = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.05)
    assert not third.done(), "a third caller waits for a slot"
    b.close()
    pool.release(b)  # a dead connection is not kept...
    c = await asyncio.wait_for(third, TIMEOUT)
    assert c is not b and c.usable  # ...the waiter gets a fresh one
    pool.release(a)
    pool.release(c)
    pool.close()
    assert not a.usable and not c.usable


def test_urls_the_lean_client_serves() -> None:
    assert plain_params("redis://127.0.0.1:6379/0") == {"host": "127.0.0.1", "port": 6379, "db": 0}
    assert plain_params("unix:///tmp/redis.sock?db=2") is not None
    assert plain_params("rediss://127.0.0.1:6380/0") is None, "TLS goes through redis-py"
    assert plain_params("redis://127.0.0.1:6379/0?protocol=3") is None

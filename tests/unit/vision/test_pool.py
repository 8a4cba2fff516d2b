"""``EncoderPool``: one build per key shared by concurrent first callers, a failed build remembered and re-raised
without building again, keys built apart, a cancelled caller not cancelling the build."""

from __future__ import annotations

import asyncio
import threading

import pytest

from embedmesh.vision.pool import EncoderBroken, EncoderPool


class Builder:
    """Builds ``("encoder", key, n)``, the n-th build; held at a gate when ``gated``; fails for keys in ``fail``."""

    def __init__(self, gated: bool = False, fail: dict[str, BaseException] | None = None) -> None:
        self.keys: list[str] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.fail = fail or {}

    def __call__(self, key: str) -> tuple[str, str, int]:
        self.keys.append(key)
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if key in self.fail:
            raise self.fail[key]
        return ("encoder", key, len(self.keys))


async def started(builder: Builder) -> None:
    assert await asyncio.to_thread(builder.started.wait, 10), "the build never started"


async def test_concurrent_first_callers_share_one_build() -> None:
    builder = Builder(gated=True)
    pool: EncoderPool[str, tuple[str, str, int]] = EncoderPool(builder)
    callers = [asyncio.create_task(pool.get("a")) for _ in range(5)]
    await started(builder)
    await asyncio.sleep(0.05)  # every caller is waiting on the build now
    assert not any(c.done() for c in callers)
    builder.gate.set()
    got = await asyncio.gather(*callers)
    assert builder.keys == ["a"]
    assert all(g is got[0] for g in got) and got[0] == ("encoder", "a", 1)
    assert await pool.get("a") is got[0] and builder.keys == ["a"]  # built: no build again


async def test_a_failed_build_is_remembered_and_re_raised_without_building_again() -> None:
    builder = Builder(fail={"a": RuntimeError("efficientnet-lite is not installed")})
    pool: EncoderPool[str, tuple[str, str, int]] = EncoderPool(builder)
    assert pool.broken("a") is None
    for _ in range(3):
        with pytest.raises(EncoderBroken) as e:
            await pool.get("a")
        assert e.value.key == "a" and e.value.why == "efficientnet-lite is not installed"
    assert builder.keys == ["a"]
    assert pool.broken("a") == "efficientnet-lite is not installed"


async def test_concurrent_callers_of_a_failing_build_all_get_its_failure_from_one_build() -> None:
    builder = Builder(gated=True, fail={"a": OSError("no embedding matrix in /models/a")})
    pool: EncoderPool[str, tuple[str, str, int]] = EncoderPool(builder)
    callers = [asyncio.create_task(pool.get("a")) for _ in range(4)]
    await started(builder)
    builder.gate.set()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, EncoderBroken) and r.why == "no embedding matrix in /models/a" for r in results)
    assert builder.keys == ["a"]


async def test_different_keys_are_built_apart_and_one_failing_does_not_break_another() -> None:
    builder = Builder(fail={"bad": ValueError("wrong hidden size")})
    pool: EncoderPool[str, tuple[str, str, int]] = EncoderPool(builder)
    a, b = await asyncio.gather(pool.get("a"), pool.get("b"))
    assert a[1] == "a" and b[1] == "b" and a is not b
    with pytest.raises(EncoderBroken):
        await pool.get("bad")
    assert await pool.get("a") is a and await pool.get("b") is b
    assert pool.broken("a") is None and pool.broken("bad") == "wrong hidden size"
    assert sorted(builder.keys) == ["a", "b", "bad"]


async def test_a_caller_cancelled_during_the_build_does_not_cancel_it() -> None:
    builder = Builder(gated=True)
    pool: EncoderPool[str, tuple[str, str, int]] = EncoderPool(builder)
    first = asyncio.create_task(pool.get("a"))
    await started(builder)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(pool.get("a"))
    builder.gate.set()
    assert await second == ("encoder", "a", 1)
    assert builder.keys == ["a"]


async def test_an_unexpected_error_reaches_the_callers_and_is_not_remembered() -> None:
    builder = Builder(fail={"a": TypeError("a bug in the builder")})
    pool: EncoderPool[str, tuple[str, str, int]] = EncoderPool(builder)
    with pytest.raises(TypeError, match="a bug in the builder"):
        await pool.get("a")
    assert pool.broken("a") is None
    del builder.fail["a"]
    assert await pool.get("a") == ("encoder", "a", 2)  # tried again: built by the second build

"""``coalesced``: a fast engine's deltas merge while the reader is behind, a reader that keeps up gets them one
by one, errors arrive after what was produced before them, and closing the reader closes the engine's stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.worker.coalesce import coalesced, merge
from embedmesh.services.worker.engines.base import FinishReason, GenerationDelta, TokenLogprob


def _d(i: int, finish: FinishReason | None = None, lp: bool = False) -> GenerationDelta:
    return GenerationDelta(str(i), (i,), i, finish, (TokenLogprob(i, -0.5, ()),) if lp else (),
                           ((TokenLogprob(0, None, ()),) if i == 1 else None))


async def _engine(n: int, *, yield_every: int = 0, fail_at: int = 0, closed: list[bool] | None = None
                  ) -> AsyncIterator[GenerationDelta]:
    try:
        for i in range(1, n + 1):
            if i == fail_at:
                raise InvalidArgument("bad", field="x")
            yield _d(i, FinishReason.LENGTH if i == n else None, lp=True)
            if yield_every and i % yield_every == 0:
                await asyncio.sleep(0)
    finally:
        if closed is not None:
            closed.append(True)


def test_merge_joins_text_ids_and_logprobs() -> None:
    m = merge([_d(1, lp=True), _d(2, lp=True), _d(3, FinishReason.STOP, lp=True)])
    assert (m.text, m.token_ids, m.completion_tokens, m.finish_reason) == ("123", (1, 2, 3), 3, FinishReason.STOP)
    assert [lp.token_id for lp in m.logprobs] == [1, 2, 3] and m.prompt_logprobs is not None


async def test_a_slow_reader_gets_merged_deltas_and_every_token() -> None:
    got = []
    async for d in coalesced(_engine(300, yield_every=64)):
        got.append(d)
        await asyncio.sleep(0.01)  # slower than the engine
    assert len(got) < 20
    assert "".join(d.text for d in got) == "".join(str(i) for i in range(1, 301))
    assert [t for d in got for t in d.token_ids] == list(range(1, 301))
    assert got[-1].finish_reason is FinishReason.LENGTH and got[-1].completion_tokens == 300


async def test_a_reader_that_keeps_up_gets_each_delta() -> None:
    async def slow() -> AsyncIterator[GenerationDelta]:
        for i in range(1, 6):
            await asyncio.sleep(0.01)
            yield _d(i, FinishReason.LENGTH if i == 5 else None)

    got = [d async for d in coalesced(slow())]
    assert [d.token_ids for d in got] == [(1,), (2,), (3,), (4,), (5,)]


async def test_errors_come_after_what_was_produced() -> None:
    got: list[GenerationDelta] = []
    with pytest.raises(InvalidArgument):
        async for d in coalesced(_engine(10, fail_at=4)):
            got.append(d)
    assert [t for d in got for t in d.token_ids] == [1, 2, 3]
    with pytest.raises(InvalidArgument):
        async for _ in coalesced(_engine(10, fail_at=1)):
            pass


async def test_closing_the_reader_closes_the_engine_stream() -> None:
    closed: list[bool] = []

    async def endless() -> AsyncIterator[GenerationDelta]:
        try:
            i = 0
            while True:
                i += 1
                yield _d(i)
                await asyncio.sleep(0.001)
        finally:
            closed.append(True)

    stream = coalesced(endless())
    first = await stream.__anext__()  # type: ignore[attr-defined]
    assert first.token_ids
    await stream.aclose()  # type: ignore[attr-defined]
    assert closed == [True]


async def test_the_engine_waits_when_the_backlog_is_full() -> None:
    produced = 0

    async def fast() -> AsyncIterator[GenerationDelta]:
        nonlocal produced
        for i in range(1, 1001):
            produced = i
            yield _d(i, FinishReason.LENGTH if i == 1000 else None)
            await asyncio.sleep(0)

    stream = coalesced(fast(), backlog=8)
    await stream.__anext__()  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)  # the reader stalls
    assert produced <= 8 + 2
    rest = [d async for d in stream]
    assert rest[-1].completion_tokens == 1000

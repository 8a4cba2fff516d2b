"""The mocker engine at its boundary: requests in, deltas out, the simulated time each step asks for, the KV
events it publishes (the chained hashes the preprocessor computes, for text, embeddings rows and adapters), its
load and determinism."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embedmesh.core.block_hash import ROOT, adapter_block_hashes, block_hashes, hash_token_blocks
from embedmesh.core.kv_events import KvEvent, Stored
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    TokenSegment,
)
from embedmesh.services.worker.engines.mocker.config import MockerOptions
from embedmesh.services.worker.engines.mocker.engine import MockerEngine

BS = 16


class Clock:
    """Records the simulated time of every step instead of sleeping."""

    def __init__(self) -> None:
        self.steps: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.steps.append(seconds)
        await asyncio.sleep(0)


def engine(clock: Clock | None = None, **kw: object) -> MockerEngine:
    o = MockerOptions(**{"mocker_prefill_ms_per_token": 1.0, "mocker_decode_ms": 0.0,
                         "mocker_decode_ms_per_seq": 0.0, **kw})  # type: ignore[arg-type]
    return MockerEngine("mocker", BS, o, sleep=clock or Clock())


def req(rid: str, ids: list[int], max_tokens: int = 2, **kw: object) -> GenerationRequest:
    return GenerationRequest(rid, [TokenSegment(tuple(ids))], SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]


async def collect(e: MockerEngine, r: GenerationRequest) -> list[GenerationDelta]:
    return [d async for d in e.generate(r)]


async def started(e: MockerEngine) -> MockerEngine:
    await e.start()
    return e


@pytest.mark.asyncio
async def test_generates_max_tokens_and_counts_the_request() -> None:
    e = await started(engine())
    out = await collect(e, req("a", list(range(40)), max_tokens=3))
    assert [d.completion_tokens for d in out] == [1, 2, 3]
    assert out[-1].finish_reason is FinishReason.LENGTH and out[0].finish_reason is None
    s = e.stats()
    assert (s.completed_requests, s.generated_tokens, s.active_requests) == (1, 3, 0)
    await e.shutdown()


@pytest.mark.asyncio
async def test_prefill_time_follows_the_uncached_tokens() -> None:
    clock = Clock()
    e = await started(engine(clock))
    prefix = list(range(64))
    await collect(e, req("a", [*prefix, 1, 2, 3, 4], max_tokens=1))
    first = clock.steps[-1]
    await collect(e, req("b", [*prefix, 9, 9, 9, 9], max_tokens=1))  # 64 of 68 positions cached
    second = clock.steps[-1]
    assert first == pytest.approx(68 / 1000) and second == pytest.approx(4 / 1000)
    assert e.counters["cached_tokens"] == 64 and e.counters["prompt_tokens"] == 136
    await e.shutdown()


@pytest.mark.asyncio
async def test_a_prompt_held_whole_still_computes_its_last_position() -> None:
    clock = Clock()
    e = await started(engine(clock))
    await collect(e, req("a", list(range(32)), max_tokens=1))
    await collect(e, req("b", list(range(32)), max_tokens=1))
    assert clock.steps[-1] == pytest.approx(1 / 1000)
    await e.shutdown()


@pytest.mark.asyncio
async def test_decode_steps_grow_with_the_batch() -> None:
    clock = Clock()
    e = await started(engine(clock, mocker_prefill_ms_per_token=0.0, mocker_decode_ms=1.0,
                             mocker_decode_ms_per_seq=1.0))
    await collect(e, req("one", [1] * 4, max_tokens=2))
    alone = clock.steps[-1]
    await asyncio.gather(*(collect(e, req(f"r{i}", [i] * 4, max_tokens=2)) for i in range(4)))
    assert alone == pytest.approx(0.002) and max(clock.steps) == pytest.approx(0.005)
    await e.shutdown()


@pytest.mark.asyncio
async def test_events_carry_the_preprocessors_hashes_for_text_embeddings_and_adapters() -> None:
    e = await started(engine())
    events: list[KvEvent] = []
    e.on_kv_events(events.extend)
    ids = list(range(40))
    await collect(e, req("t", ids, max_tokens=1))
    assert events == [Stored(ROOT, tuple(hash_token_blocks(ids, BS)))]
    rows = np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
    events.clear()
    await collect(e, GenerationRequest("e", [EmbedsSegment(rows), TokenSegment((5,) * 8)],
                                       SamplingParams(max_tokens=1)))
    assert events == [Stored(ROOT, tuple(block_hashes([rows, (5,) * 8], BS)))]
    events.clear()
    await collect(e, req("l", ids, max_tokens=1, lora_adapter="ad"))
    assert events == [Stored(ROOT, tuple(adapter_block_hashes(hash_token_blocks(ids, BS), "ad")))]
    assert {h for ev in e.kv_snapshot() for h in ev.block_hashes} >= set(hash_token_blocks(ids, BS))  # type: ignore[union-attr]
    await e.shutdown()


@pytest.mark.asyncio
async def test_the_same_prompt_gives_the_same_tokens_and_the_seed_changes_them() -> None:
    async def tokens(seed: int, ids: list[int]) -> tuple[int, ...]:
        e = await started(engine(mocker_seed=seed))
        out = await collect(e, req("x", ids, max_tokens=8))
        await e.shutdown()
        return tuple(t for d in out for t in d.token_ids)

    ids = list(range(48))
    assert await tokens(1, ids) == await tokens(1, ids)
    assert await tokens(1, ids) != await tokens(2, ids)
    assert await tokens(1, ids) != await tokens(1, [*ids[:-1], 999])


@pytest.mark.asyncio
async def test_runs_of_the_same_trace_publish_the_same_events() -> None:
    async def trace(seed: int) -> list[KvEvent]:
        e = await started(engine(mocker_seed=seed, mocker_num_blocks=12, mocker_max_context_tokens=64))
        events: list[KvEvent] = []
        e.on_kv_events(events.extend)
        for i in range(20):
            await collect(e, req(f"r{i}", [i % 5] * 32 + [i] * 16, max_tokens=4))
        await e.shutdown()
        return events

    first = await trace(3)
    assert first == await trace(3)
    assert any(type(ev).__name__ == "Removed" for ev in first)  # the small cache evicted


@pytest.mark.asyncio
async def test_abort_and_a_closed_stream_free_their_blocks() -> None:
    e = await started(engine(mocker_decode_ms=50.0, mocker_speedup=10.0))
    it = e.generate(req("a", list(range(64)), max_tokens=1000))
    first = await it.__anext__()
    assert first.completion_tokens == 1 and e.kv_usage() > 0
    assert await e.abort("a")
    rest = [d async for d in it]
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert e.kv_usage() == 0 and e.stats().aborted_requests == 1
    it2 = e.generate(req("b", list(range(64)), max_tokens=1000))
    await it2.__anext__()
    await it2.aclose()  # the client went away
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert e.kv_usage() == 0 and e.stats().active_requests == 0
    assert not await e.abort("zzz")
    await e.shutdown()


@pytest.mark.asyncio
async def test_a_full_cache_queues_requests_until_blocks_are_free() -> None:
    e = await started(engine(mocker_num_blocks=4, mocker_max_context_tokens=64))
    results = await asyncio.gather(*(collect(e, req(f"r{i}", [i] * 48, max_tokens=16)) for i in range(3)))
    assert all(r[-1].finish_reason is FinishReason.LENGTH for r in results)
    assert e.stats().max_batch_seen == 1 and e.cache.used_blocks == 0  # one at a time: 4 blocks each
    await e.shutdown()


@pytest.mark.asyncio
async def test_clear_kv_blocks_and_lora_bookkeeping() -> None:
    e = await started(engine())
    await collect(e, req("a", list(range(32)), max_tokens=1))
    events: list[KvEvent] = []
    e.on_kv_events(events.extend)
    assert await e.clear_kv_blocks()
    assert type(events[-1]).__name__ == "Cleared" and e.kv_snapshot() == []
    assert await e.load_lora("ad", "/x") and not await e.load_lora("ad", "/x")
    assert e.lora_names() == ["ad"] and await e.list_loras() == {"ad": "/x"}
    assert await e.unload_lora("ad") and e.lora_names() == []
    await e.shutdown()


@pytest.mark.asyncio
async def test_a_scheduler_that_breaks_fails_its_requests_and_the_health_check() -> None:
    async def broken(seconds: float) -> None:
        raise ValueError("boom")

    e = MockerEngine("mocker", BS, MockerOptions(), sleep=broken)
    await e.start()
    with pytest.raises(RuntimeError, match="scheduler stopped"):
        await collect(e, req("a", list(range(40))))
    with pytest.raises(RuntimeError, match="boom"):
        await e.check_health()
    with pytest.raises(RuntimeError):
        await collect(e, req("b", list(range(40))))
    await e.shutdown()


@pytest.mark.asyncio
async def test_a_request_aborted_during_its_prefill_stores_nothing() -> None:
    e: MockerEngine

    async def abort_meanwhile(seconds: float) -> None:
        await e.abort("a")

    e = await started(MockerEngine("mocker", BS, MockerOptions(), sleep=abort_meanwhile))
    events: list[KvEvent] = []
    e.on_kv_events(events.extend)
    out = await collect(e, req("a", list(range(40))))
    assert out[-1].finish_reason is FinishReason.ABORT
    assert events == [] and e.cache.used_blocks == 0 and e.cache.cached_blocks == 0
    await e.shutdown()

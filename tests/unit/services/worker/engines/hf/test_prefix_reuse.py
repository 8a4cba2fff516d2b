"""The hf engine's prefix cache on the real SmolLM2 weights: a prompt that shares full blocks with an earlier one
prefills only its suffix, and its greedy text equals the text computed without the cache — for text, for
``prompt_embeds`` rows, under a LoRA adapter, for several rows with different cached lengths prefilled together,
and for a resumed stream. What it holds is published as the mesh's KV events, in the hashes the router computes
(``core.block_hash``), and ClearKvBlocks / an adapter's unload / the budget remove it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from embedmesh.core.block_hash import adapter_block_hashes, block_hashes
from embedmesh.core.kv_events import Cleared, KvEvent, Removed, Stored
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import EmbedsSegment, GenerationDelta, GenerationRequest, TokenSegment
from tests.support.lora import save_smol_adapter

BLOCK = 16
TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew into "
        "a market town, then a port, and finally the capital of a large region with many roads and bridges. ")


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[Any]:
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4, block_size=BLOCK,
                                prefix_cache_blocks=64))
    events: list[KvEvent] = []
    e.on_kv_events(events.extend)
    e.events = events  # type: ignore[attr-defined]
    await e.start()
    yield e
    await e.shutdown()


_ids = iter(range(10**6))


async def _run(engine: Any, segments: list[Any], n: int = 8, resumed: tuple[int, ...] = (), lora: str = "",
               settle: bool = True) -> list[GenerationDelta]:
    req = GenerationRequest(f"p{next(_ids)}", segments, SamplingParams(max_tokens=n, temperature=0.0),
                            resumed=resumed, lora_adapter=lora)
    out = [d async for d in engine.generate(req)]
    if settle:
        await _settle(engine)
    return out


def _ids_of(deltas: list[GenerationDelta]) -> tuple[int, ...]:
    return tuple(t for d in deltas for t in d.token_ids)


async def _uncached(engine: Any, segments: list[Any], **kw: Any) -> tuple[int, ...]:
    """The output with the cache off (nothing looked up, nothing stored)."""
    cache = engine.prefix_cache
    capacity, cache.capacity = cache.capacity, 0
    try:
        return _ids_of(await _run(engine, segments, **kw))
    finally:
        cache.capacity = capacity


def _tokens(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer(text).input_ids)


def _hit(engine: Any) -> int:
    return int(engine.prefix_cache.counters["hit_tokens"])


def _stored(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, Stored) for h in e.block_hashes]


async def _settle(engine: Any) -> None:
    """The engine thread has ended its step (the blocks it stores after the last token are stored) and the events
    reached the listeners (through the event loop)."""
    while engine.progress().busy:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)


async def test_a_shared_prefix_prefills_only_its_suffix_and_greedy_text_is_unchanged(engine: Any) -> None:
    await engine.clear_kv_blocks()
    base = _tokens(engine, TEXT)
    a, b = base + _tokens(engine, " Tell me about its port."), base + _tokens(engine, " What is its name?")
    assert len(base) >= 2 * BLOCK
    want_b = await _uncached(engine, [TokenSegment(b)])
    engine.events.clear()
    first_a = _ids_of(await _run(engine, [TokenSegment(a)]))
    # A's full blocks are published, in the router's hashes of A's prompt (then those its output filled).
    hashes_a = block_hashes([a], BLOCK)
    assert _stored(engine.events)[:len(hashes_a)] == hashes_a
    assert engine.events[0] == Stored(0, tuple(hashes_a))
    before = _hit(engine)
    got_b = _ids_of(await _run(engine, [TokenSegment(b)]))
    shared = sum(1 for x, y in zip(block_hashes([a], BLOCK), block_hashes([b], BLOCK), strict=False) if x == y)
    assert shared >= 2 and _hit(engine) - before == shared * BLOCK
    assert got_b == want_b
    # The same prompt again: every block but the one holding its last position is reused; same text.
    before = _hit(engine)
    assert _ids_of(await _run(engine, [TokenSegment(a)])) == first_a
    assert _hit(engine) - before == (len(a) - 1) // BLOCK * BLOCK
    # The worker registers the engine as a KV event source and exports the cache's figures.
    assert engine.kv_event_source() is engine
    names = {m.name for m in engine.metrics_collector("w").collect()}
    assert {"embedmesh_hf_prefix_hit_tokens", "embedmesh_hf_prefix_blocks"} <= names


async def test_embedding_rows_are_keyed_by_content_and_reuse_gives_the_same_text(engine: Any) -> None:
    import torch

    ids = _tokens(engine, TEXT + " Describe the bridges.")
    with torch.no_grad():
        rows = engine.embed(torch.tensor(ids)).numpy()
    by_ids = await _uncached(engine, [TokenSegment(ids)])
    await engine.clear_kv_blocks()
    await _run(engine, [TokenSegment(ids)])  # the text's blocks do not serve the rows: other hashes
    engine.events.clear()
    before = _hit(engine)
    first = _ids_of(await _run(engine, [EmbedsSegment(rows)]))
    assert _hit(engine) == before
    assert _stored(engine.events)[:len(ids) // BLOCK] == block_hashes([rows], BLOCK)
    again = _ids_of(await _run(engine, [EmbedsSegment(rows)]))
    assert _hit(engine) - before == (len(ids) - 1) // BLOCK * BLOCK
    assert first == again == by_ids


async def test_rows_with_different_cached_lengths_prefilled_together(engine: Any) -> None:
    """Two prompts admitted in one prefill (a running request keeps the engine busy meanwhile), one with a long
    cached prefix and one with a short one: each gives its text without the cache."""
    base = _tokens(engine, TEXT)
    long_p = base + _tokens(engine, " The bridges were built of stone and wood by the people who lived there.")
    short_p = base[:BLOCK + 3] + _tokens(engine, " and more")
    want = [await _uncached(engine, [TokenSegment(p)]) for p in (long_p, short_p)]
    await engine.clear_kv_blocks()
    await _run(engine, [TokenSegment(long_p)], n=1)  # caches the long prompt's blocks
    before = _hit(engine)
    stream = engine.generate(GenerationRequest(f"p{next(_ids)}", [TokenSegment(_tokens(engine, "Hi"))],
                                               SamplingParams(max_tokens=40, temperature=0.0)))
    await stream.__anext__()  # the engine is decoding: the next two wait and are admitted together
    got = await asyncio.gather(*(_run(engine, [TokenSegment(p)], settle=False) for p in (long_p, short_p)))
    await stream.aclose()
    await _settle(engine)
    assert [_ids_of(g) for g in got] == want
    assert _hit(engine) - before == ((len(long_p) - 1) // BLOCK + 1) * BLOCK


async def test_a_resumed_stream_reuses_the_prompt_and_continues_exactly(engine: Any) -> None:
    await engine.clear_kv_blocks()
    prompt = [TokenSegment(_tokens(engine, TEXT + " In short,"))]
    full = _ids_of(await _run(engine, prompt, n=12))
    before = _hit(engine)
    rest = _ids_of(await _run(engine, prompt, n=7, resumed=full[:5]))
    assert _hit(engine) > before
    assert full[:5] + rest == full


async def test_an_adapter_keys_its_own_blocks_and_unload_removes_them(engine: Any, tmp_path: Path) -> None:
    adapter = save_smol_adapter(tmp_path / "a")
    await engine.load_lora("ad", str(adapter))
    ids = _tokens(engine, TEXT + " Summarise.")
    plain = await _uncached(engine, [TokenSegment(ids)])
    want = await _uncached(engine, [TokenSegment(ids)], lora="ad")
    assert want != plain  # the adapter changes the text: equal outputs below are the cache's doing
    await engine.clear_kv_blocks()
    await _run(engine, [TokenSegment(ids)])  # base blocks: never used for the adapter
    engine.events.clear()
    before = _hit(engine)
    assert _ids_of(await _run(engine, [TokenSegment(ids)], lora="ad")) == want
    assert _hit(engine) == before
    assert _ids_of(await _run(engine, [TokenSegment(ids)], lora="ad")) == want
    assert _hit(engine) > before
    mine = adapter_block_hashes(block_hashes([ids], BLOCK), "ad")
    assert _stored(engine.events)[:len(mine)] == mine
    assert await engine.unload_lora("ad")
    await _settle(engine)
    removed = {h for e in engine.events if isinstance(e, Removed) for h in e.block_hashes}
    assert set(mine) <= removed and not any(h in engine.prefix_cache for h in mine)
    assert block_hashes([ids], BLOCK)[0] in engine.prefix_cache  # the base model's blocks stay


async def test_clear_and_the_budget(engine: Any) -> None:
    ids = _tokens(engine, TEXT * 3)
    await _run(engine, [TokenSegment(ids)], n=1)
    engine.events.clear()
    assert await engine.clear_kv_blocks() is True
    await _settle(engine)
    assert engine.events == [Cleared()] and len(engine.prefix_cache) == 0 and engine.kv_snapshot() == []
    cache = engine.prefix_cache
    cache.capacity = 4
    try:
        # A prompt longer than the whole cache keeps its head; blocks stored and evicted at once are not published.
        await _run(engine, [TokenSegment(ids)], n=1)
        hashes = block_hashes([ids], BLOCK)
        assert len(hashes) > 4 and len(cache) == 4
        assert engine.events == [Cleared(), Stored(0, tuple(hashes[:4]))]
        assert engine.kv_snapshot() == [Stored(0, tuple(hashes[:4]))]
        # Another prompt evicts them, least recently used first.
        other = _tokens(engine, "Write a poem about the sea, the wind and the ships that sail far away. " * 4)
        await _run(engine, [TokenSegment(other)], n=1)
        removed = [h for e in engine.events if isinstance(e, Removed) for h in e.block_hashes]
        assert sorted(removed) == sorted(hashes[:4]) and removed[-1] == hashes[0]
        assert engine.kv_snapshot() == [Stored(0, tuple(block_hashes([other], BLOCK)[:4]))]
    finally:
        cache.capacity = 64


async def test_prompt_logprobs_look_nothing_up_even_beside_a_cached_row(engine: Any) -> None:
    """A request that scores its prompt needs every position's logits: it is prefilled whole, here in the same
    prefill as a row that reuses cached blocks, and both equal their runs without the cache."""
    await engine.clear_kv_blocks()
    prompt = _tokens(engine, TEXT + " Name three bridges.")

    async def scored() -> tuple[Any, ...]:
        req = GenerationRequest(f"p{next(_ids)}", [TokenSegment(prompt)],
                                SamplingParams(max_tokens=0, prompt_logprobs=1))
        return tuple(lp for d in [d async for d in engine.generate(req)] for lp in d.prompt_logprobs or ())

    cache = engine.prefix_cache
    cache.capacity = 0
    want_lp, want_ids = await scored(), _ids_of(await _run(engine, [TokenSegment(prompt)]))
    cache.capacity = 64
    await _settle(engine)
    await _run(engine, [TokenSegment(prompt)], n=1)  # caches the prompt's blocks
    before = _hit(engine)
    stream = engine.generate(GenerationRequest(f"p{next(_ids)}", [TokenSegment(_tokens(engine, "Hi"))],
                                               SamplingParams(max_tokens=40, temperature=0.0)))
    await stream.__anext__()
    got_lp, got = await asyncio.gather(scored(), _run(engine, [TokenSegment(prompt)], settle=False))
    await stream.aclose()
    await _settle(engine)
    assert _hit(engine) - before == (len(prompt) - 1) // BLOCK * BLOCK  # the unscored row's only
    assert len(got_lp) == len(prompt) and [lp.token_id for lp in got_lp] == [lp.token_id for lp in want_lp]
    assert [lp.logprob for lp in got_lp[1:]] == pytest.approx([lp.logprob for lp in want_lp[1:]], abs=1e-4)
    assert _ids_of(got) == want_ids

"""The hf engine on the real SmolLM2 weights: batching, exactness of embeddings vs ids, sampling, abort."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    TokenSegment,
)


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[Any]:
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf import HFEngine, HFEngineConfig

    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4))
    await e.start()
    yield e
    await e.shutdown()


_ids = iter(range(10**6))


async def run(engine: Any, segments: list[Any], **sampling: Any) -> tuple[str, list[GenerationDelta]]:
    sampling.setdefault("temperature", 0.0)
    req = GenerationRequest(f"t{next(_ids)}", segments, SamplingParams(**sampling))
    out = [d async for d in engine.generate(req)]
    return "".join(d.text for d in out), out


def ids_of(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer(text).input_ids)


async def test_embeddings_and_ids_give_identical_greedy_text(engine: Any) -> None:
    import torch

    ids = ids_of(engine, "The capital of France is")
    with torch.no_grad():
        rows = engine.embed(torch.tensor(ids)).numpy()
    by_ids, _ = await run(engine, [TokenSegment(ids)], max_tokens=12)
    by_rows, deltas = await run(engine, [EmbedsSegment(rows)], max_tokens=12)
    assert by_ids == by_rows and by_ids
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert deltas[-1].completion_tokens == 12
    assert sum(1 for d in deltas if d.finish_reason is not None) == 1


async def test_mixed_segments_equal_the_concatenated_ids(engine: Any) -> None:
    import torch

    a, b = ids_of(engine, "The capital of"), ids_of(engine, " France is")
    with torch.no_grad():
        rows_b = engine.embed(torch.tensor(b)).numpy()
    whole, _ = await run(engine, [TokenSegment(a + b)], max_tokens=8)
    mixed, _ = await run(engine, [TokenSegment(a), EmbedsSegment(rows_b)], max_tokens=8)
    assert mixed == whole


async def test_concurrent_requests_are_batched_and_match_solo_runs(engine: Any) -> None:
    prompts = ["One, two, three,", "The capital of France is", "def fibonacci(n):", "Roses are red,"]
    solo = [(await run(engine, [TokenSegment(ids_of(engine, p))], max_tokens=10))[0] for p in prompts]
    before = engine.stats().max_batch_seen
    together = await asyncio.gather(*[run(engine, [TokenSegment(ids_of(engine, p))], max_tokens=10)
                                      for p in prompts])
    assert engine.stats().max_batch_seen >= 2, "concurrent requests were not decoded in one batch"
    assert before <= engine.stats().max_batch_seen
    assert [t for t, _ in together] == solo


async def test_requests_arriving_mid_batch_join_it(engine: Any) -> None:
    first = asyncio.create_task(run(engine, [TokenSegment(ids_of(engine, "Once upon a time"))], max_tokens=30))
    await asyncio.sleep(0.3)
    late, _ = await run(engine, [TokenSegment(ids_of(engine, "Roses are red,"))], max_tokens=5)
    assert not first.done(), "the late request waited for the whole first one"
    solo_late, _ = await run(engine, [TokenSegment(ids_of(engine, "Roses are red,"))], max_tokens=5)
    assert late == solo_late
    await first


async def test_same_seed_same_text_different_seed_differs(engine: Any) -> None:
    ids = ids_of(engine, "Once upon a time")
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.95)
    a, _ = await run(engine, [TokenSegment(ids)], seed=7, **kw)
    b, _ = await run(engine, [TokenSegment(ids)], seed=7, **kw)
    others = {(await run(engine, [TokenSegment(ids)], seed=s, **kw))[0] for s in (8, 9, 10)}
    assert a == b
    assert len(others | {a}) > 1


async def test_top_k_one_is_greedy(engine: Any) -> None:
    ids = ids_of(engine, "The capital of France is")
    greedy, _ = await run(engine, [TokenSegment(ids)], max_tokens=8)
    k1, _ = await run(engine, [TokenSegment(ids)], max_tokens=8, temperature=1.5, top_k=1, seed=1)
    assert k1 == greedy


async def test_closing_the_stream_aborts_the_sequence(engine: Any) -> None:
    before = engine.stats()
    aborted, tokens = before.aborted_requests, before.generated_tokens
    req = GenerationRequest("abort-me", [TokenSegment(ids_of(engine, "Tell me a story"))],
                            SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    stream = engine.generate(req)
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()
    for _ in range(100):
        if engine.stats().aborted_requests > aborted:
            break
        await asyncio.sleep(0.05)
    assert engine.stats().aborted_requests == aborted + 1
    assert engine.stats().generated_tokens - tokens < 100


async def test_abort_by_id(engine: Any) -> None:
    req = GenerationRequest("by-id", [TokenSegment(ids_of(engine, "Count to a thousand:"))],
                            SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    deltas: list[GenerationDelta] = []

    async def consume() -> None:
        async for d in engine.generate(req):
            deltas.append(d)

    task = asyncio.create_task(consume())
    while not deltas:
        await asyncio.sleep(0.05)
    assert await engine.abort("by-id")
    await asyncio.wait_for(task, 30)
    assert deltas[-1].finish_reason is FinishReason.ABORT
    assert deltas[-1].completion_tokens < 400
    assert not await engine.abort("by-id")


@pytest.mark.parametrize(
    "segments,field",
    [
        ([TokenSegment((1, 2, 10**7))], "prompt"),
        ([EmbedsSegment(np.zeros((3, 100), np.float32))], "prompt_embeds"),
        ([], "prompt"),
    ],
)
async def test_bad_prompts_are_rejected_before_queueing(engine: Any, segments: list[Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await run(engine, segments, max_tokens=2)
    assert info.value.field == field


async def test_context_overflow_names_max_tokens(engine: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        await run(engine, [TokenSegment((1, 2, 3))], max_tokens=engine.info().max_context_tokens)
    assert info.value.field == "max_tokens"

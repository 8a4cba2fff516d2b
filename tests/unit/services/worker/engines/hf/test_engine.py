"""The hf engine on the real SmolLM2 weights: batching, exactness of embeddings vs ids, sampling, abort, and
containment: numerically extreme sampling, a row gone non-finite, a failing step, a dead engine thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InternalError, InvalidArgument, Unavailable
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
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

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


# --- containment ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6, 2e-5])
async def test_tiny_temperatures_decode_like_greedy(engine: Any, temperature: float) -> None:
    ids = ids_of(engine, "The capital of France is")
    greedy, _ = await run(engine, [TokenSegment(ids)], max_tokens=8)
    tiny, deltas = await run(engine, [TokenSegment(ids)], max_tokens=8, temperature=temperature, seed=3)
    assert tiny == greedy
    assert deltas[-1].completion_tokens == 8


async def test_extreme_temperature_and_top_p_give_a_valid_distribution(engine: Any) -> None:
    ids = ids_of(engine, "The capital of France is")
    greedy, _ = await run(engine, [TokenSegment(ids)], max_tokens=6)
    # Near-uniform at temperature 100; a top_p below the best token's mass keeps exactly that token.
    narrow, _ = await run(engine, [TokenSegment(ids)], max_tokens=6, temperature=100.0, top_p=1e-9, seed=5)
    assert narrow == greedy
    wide, deltas = await run(engine, [TokenSegment(ids)], max_tokens=6, temperature=100.0, top_k=5, seed=5)
    assert deltas[-1].completion_tokens == 6 and all(0 <= t < engine.info().vocab_size
                                                     for d in deltas for t in d.token_ids)


async def _started(engine: Any, request_id: str, text: str, max_tokens: int) -> tuple[asyncio.Task[Any], Any]:
    """A long greedy request, running (its first delta received) when this returns."""
    req = GenerationRequest(request_id, [TokenSegment(ids_of(engine, text))],
                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    stream = engine.generate(req)
    first = await stream.__anext__()

    async def rest() -> str:
        return first.text + "".join([d.text async for d in stream])

    return asyncio.create_task(rest()), req


async def solo(engine: Any, req: GenerationRequest) -> str:
    return (await run(engine, req.segments, max_tokens=req.sampling.max_tokens, ignore_eos=True))[0]


async def test_nan_rows_fail_alone_while_the_running_batch_goes_on(engine: Any) -> None:
    running, req = await _started(engine, "runs-on", "Once upon a time", 40)
    rows = np.full((4, engine.info().hidden_size), np.nan, np.float32)
    # Sent straight to the engine (no worker validation in between): the model's output for this row is NaN.
    with pytest.raises(InvalidArgument) as info:
        await run(engine, [TokenSegment(ids_of(engine, "Hello")), EmbedsSegment(rows)], max_tokens=5)
    assert info.value.reason == "NON_FINITE_COMPUTATION"
    assert info.value.field == "prompt_embeds"
    assert "non-finite" in str(info.value) and "magnitudes" in str(info.value)
    assert not running.done(), "the poisoned row should have failed while the other one was still decoding"
    assert await running == await solo(engine, req)
    assert engine.progress().failed is None


async def test_a_row_going_non_finite_mid_decode_fails_alone(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    original = engine._sample_rows

    def poison(logits: Any, seqs: list[Any]) -> None:
        for i, s in enumerate(seqs):
            if s.request.request_id == "poisoned" and len(s.generated) >= 3:
                logits[i] = float("inf")
        original(logits, seqs)

    monkeypatch.setattr(engine, "_sample_rows", poison)
    running, req = await _started(engine, "healthy", "Roses are red,", 30)
    poisoned = GenerationRequest("poisoned", [TokenSegment(ids_of(engine, "Count to ten:"))],
                                 SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    got: list[GenerationDelta] = []
    with pytest.raises(InvalidArgument) as info:
        async for d in engine.generate(poisoned):
            got.append(d)
    assert info.value.reason == "NON_FINITE_COMPUTATION" and info.value.field == "prompt"
    assert sum(len(d.token_ids) for d in got) <= 3
    monkeypatch.setattr(engine, "_sample_rows", original)
    assert await running == await solo(engine, req)


async def test_a_failing_prefill_fails_only_the_new_sequences(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    running, req = await _started(engine, "survivor", "The quick brown fox", 30)
    forward = engine.model.forward

    def broken_prefill(*args: Any, **kwargs: Any) -> Any:
        if kwargs["inputs_embeds"].shape[1] > 1:  # a prefill; decode steps feed one position
            raise RuntimeError("simulated kernel failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", broken_prefill)
    with pytest.raises(InternalError) as info:
        await run(engine, [TokenSegment(ids_of(engine, "Hello there"))], max_tokens=4)
    assert "simulated" not in str(info.value), "internals must not reach the client"
    monkeypatch.setattr(engine.model, "forward", forward)
    assert await running == await solo(engine, req)


async def test_a_failing_decode_step_fails_its_batch_and_the_engine_goes_on(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, req = await _started(engine, "victim", "Tell me a story", 30)
    forward = engine.model.forward
    calls = {"n": 0}

    def broken_once(*args: Any, **kwargs: Any) -> Any:
        if kwargs["inputs_embeds"].shape[1] == 1 and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("simulated decode failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", broken_once)
    with pytest.raises(InternalError):
        await running
    monkeypatch.setattr(engine.model, "forward", forward)
    assert calls["n"] == 1
    assert engine.progress().failed is None
    again, _ = await run(engine, req.segments, max_tokens=5)
    assert again


async def test_progress_counts_work_and_reports_busy(engine: Any) -> None:
    before = engine.progress()
    await run(engine, [TokenSegment(ids_of(engine, "One, two,"))], max_tokens=3)
    after = engine.progress()
    # Every decoder layer run counts: 1 prefill + 2 decode steps.
    assert after.steps >= before.steps + 3 * engine.model.config.num_hidden_layers
    assert after.failed is None
    running, _ = await _started(engine, "busy", "Once upon a time", 40)
    assert engine.progress().busy
    await engine.abort("busy")
    await running


@pytest.fixture
async def doomed() -> AsyncIterator[Any]:
    """An engine of its own: these tests stop it for good."""
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=2))
    await e.start()
    yield e
    await e.shutdown()


class _Fatal(BaseException):
    """Not an Exception: passes every per-step guard, as a truly fatal error would."""


async def test_a_dead_engine_thread_fails_waiting_and_later_requests_at_once(
    doomed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, _ = await _started(doomed, "in-flight", "Once upon a time", 100)

    def fatal(*args: Any, **kwargs: Any) -> Any:
        raise _Fatal()

    monkeypatch.setattr(doomed, "_decode_guarded", fatal)
    with pytest.raises(Unavailable) as info:
        await running
    assert info.value.reason == "ENGINE_FAILED"
    doomed._thread.join()
    assert doomed.progress().failed is not None
    with pytest.raises(Unavailable) as later:
        await run(doomed, [TokenSegment((1, 2, 3))], max_tokens=2)
    assert later.value.reason == "ENGINE_FAILED" and "retry" in str(later.value)


async def test_fail_all_fails_pending_requests_and_refuses_new_ones(doomed: Any) -> None:
    running, _ = await _started(doomed, "pending", "Once upon a time", 400)
    error = Unavailable("stalled; retry elsewhere", reason="ENGINE_STALLED", retry_after_seconds=1.0)
    assert doomed.fail_all(error) == 1
    with pytest.raises(Unavailable) as info:
        await running
    assert info.value.reason == "ENGINE_STALLED"
    with pytest.raises(Unavailable) as later:
        await run(doomed, [TokenSegment((1, 2, 3))], max_tokens=2)
    assert later.value.reason == "ENGINE_STALLED" and later.value.retry_after_seconds == 1.0

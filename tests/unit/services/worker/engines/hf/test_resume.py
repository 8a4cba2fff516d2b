"""A resumed generation on the hf engine (a stream migrated from a lost worker, ``GenerationRequest.resumed``), on
the real SmolLM2 weights: cut an undisturbed run after some of its deltas, resume from the ids the client got, and
the text that follows is exactly the rest of the undisturbed run's — greedy, seeded sampling (its offset), with
penalties, from embedding rows, and with a stop string whose prefix was held back at the cut."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import EmbedsSegment, GenerationDelta, GenerationRequest, TokenSegment


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[Any]:
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4))
    await e.start()
    yield e
    await e.shutdown()


_ids = iter(range(10**6))


async def _run(engine: Any, segments: list[Any], resumed: tuple[int, ...] = (), **sampling: Any
               ) -> list[GenerationDelta]:
    req = GenerationRequest(f"r{next(_ids)}", segments, SamplingParams(**sampling), resumed=resumed)
    return [d async for d in engine.generate(req)]


async def _check_cuts(engine: Any, segments: list[Any], **sampling: Any) -> str:
    """Resume after the first delta, a middle one and the one before the last; each continuation completes the
    undisturbed text and ids."""
    full = await _run(engine, segments, **sampling)
    text = "".join(d.text for d in full)
    ids = tuple(t for d in full for t in d.token_ids)
    assert text and (len(ids) == sampling["max_tokens"] or sampling.get("stop"))
    for cut in sorted({1, len(full) // 2, len(full) - 1} - {0}):
        sent_ids = tuple(t for d in full[:cut] for t in d.token_ids)
        sent_text = "".join(d.text for d in full[:cut])
        rest = await _run(engine, segments, sent_ids, **{**sampling, "max_tokens": sampling["max_tokens"]
                                                         - len(sent_ids)})
        assert sent_text + "".join(d.text for d in rest) == text, cut
        assert sent_ids + tuple(t for d in rest for t in d.token_ids) == ids, cut
        assert rest[-1].finish_reason is full[-1].finish_reason
        assert rest[-1].completion_tokens == len(ids) - len(sent_ids)  # only the new tokens
    return text


def _prompt(engine: Any, text: str) -> list[Any]:
    return [TokenSegment(tuple(engine.tokenizer(text).input_ids))]


async def test_greedy_resumes_exactly(engine: Any) -> None:
    await _check_cuts(engine, _prompt(engine, "The capital of France is"), max_tokens=10, temperature=0.0)


async def test_seeded_sampling_resumes_with_its_offset(engine: Any) -> None:
    prompt = _prompt(engine, "Once upon a time")
    text = await _check_cuts(engine, prompt, max_tokens=8, temperature=1.0, seed=11)
    # The seed matters (so the equality above is the offset's doing, not a greedy-looking distribution).
    other = await _run(engine, prompt, max_tokens=8, temperature=1.0, seed=12)
    assert "".join(d.text for d in other) != text


async def test_penalties_see_the_resumed_tokens(engine: Any) -> None:
    await _check_cuts(engine, _prompt(engine, "List: apple, apple, apple,"), max_tokens=8, temperature=0.0,
                           frequency_penalty=1.5, repetition_penalty=1.3, min_tokens=6)


async def test_embedding_rows_resume_exactly(engine: Any) -> None:
    import torch

    ids = engine.tokenizer("The capital of France is").input_ids
    with torch.no_grad():
        rows = engine.embed(torch.tensor(ids)).numpy()
    by_rows = await _check_cuts(engine, [EmbedsSegment(rows)], max_tokens=8, temperature=0.0)
    by_ids = "".join(d.text for d in await _run(engine, [TokenSegment(tuple(ids))], max_tokens=8, temperature=0.0))
    assert by_rows == by_ids


async def test_a_stop_string_spanning_the_cut(engine: Any) -> None:
    prompt = _prompt(engine, "The capital of France is")
    free = "".join(d.text for d in await _run(engine, prompt, max_tokens=10, temperature=0.0))
    words = free.split()
    assert len(words) >= 3
    stop = f"{words[1]} {words[2]}"  # held back at its first word, then ends the text
    text = await _check_cuts(engine, prompt, max_tokens=10, temperature=0.0, stop=(stop,))
    assert stop not in text and free.startswith(text)

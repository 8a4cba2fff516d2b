"""The hf engine's per-request logits work inside its continuous batch: log-probabilities (against transformers
computing them itself), prompt log-probabilities and max_tokens 0, logit_bias, penalties, min_tokens, grammars."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from embedmesh.core.sampling import SamplingParams, Structured
from embedmesh.services.worker.engines.base import FinishReason, GenerationDelta, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.hf import logits as logits_ops

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[Any]:
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4))
    await e.start()
    yield e
    await e.shutdown()


_ids = iter(range(10**6))


async def run(engine: Any, ids: tuple[int, ...], **sampling: Any) -> tuple[list[int], list[GenerationDelta]]:
    sampling.setdefault("temperature", 0.0)
    req = GenerationRequest(f"l{next(_ids)}", [TokenSegment(ids)], SamplingParams(**sampling))
    out = [d async for d in engine.generate(req)]
    return [t for d in out for t in d.token_ids], out


def rows_of(engine: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return torch.log_softmax(engine.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def ids_of(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer(text).input_ids)


async def test_generated_logprobs_equal_transformers(engine: Any) -> None:
    prompt = ids_of(engine, "The capital of France is")
    tokens, deltas = await run(engine, prompt, max_tokens=5, logprobs=3)
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == tokens and len(tokens) == 5
    rows = rows_of(engine, [*prompt, *tokens])
    for j, lp in enumerate(lps):
        row = rows[len(prompt) - 1 + j]
        assert lp.logprob == pytest.approx(float(row[tokens[j]]), abs=1e-4)
        top = row.topk(3)
        assert [t for t, _ in lp.top][:3] == top.indices.tolist()
        assert [v for _, v in lp.top][:3] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert engine.token_text(tokens[0]) == engine.tokenizer.decode([tokens[0]])


async def test_prompt_logprobs_and_max_tokens_zero(engine: Any) -> None:
    prompt = ids_of(engine, "One, two, three, four")
    tokens, deltas = await run(engine, prompt, max_tokens=0, prompt_logprobs=2)
    assert tokens == [] and len(deltas) == 1
    d = deltas[0]
    assert d.finish_reason is FinishReason.LENGTH and d.completion_tokens == 0
    assert d.prompt_logprobs is not None and len(d.prompt_logprobs) == len(prompt)
    assert d.prompt_logprobs[0].logprob is None
    rows = rows_of(engine, list(prompt))
    for t in range(1, len(prompt)):
        assert d.prompt_logprobs[t].token_id == prompt[t]
        assert d.prompt_logprobs[t].logprob == pytest.approx(float(rows[t - 1][prompt[t]]), abs=1e-4)
    # With generation too: the prompt's log-probabilities come once, on the first delta.
    tokens, deltas = await run(engine, prompt, max_tokens=3, prompt_logprobs=0)
    assert deltas[0].prompt_logprobs is not None and all(x.prompt_logprobs is None for x in deltas[1:])
    assert len(tokens) == 3


async def test_logit_bias_forces_and_forbids(engine: Any) -> None:
    prompt = ids_of(engine, "The capital of France is")
    plain, _ = await run(engine, prompt, max_tokens=2)
    forced = ids_of(engine, " banana")[0]
    tokens, _ = await run(engine, prompt, max_tokens=3, logit_bias=((forced, 100.0),))
    assert tokens == [forced] * 3
    tokens, _ = await run(engine, prompt, max_tokens=1, logit_bias=((plain[0], -100.0),))
    assert tokens[0] != plain[0]


async def test_penalties_follow_a_reference_loop(engine: Any) -> None:
    import torch

    prompt = list(ids_of(engine, "one one one one one one"))
    counts: dict[int, int] = {}
    cur, want = list(prompt), []
    for _ in range(6):
        with torch.no_grad():
            row = engine.model(torch.tensor([cur])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(cur)))
        v = row[seen]
        row[seen] = torch.where(v > 0, v / 1.3, v * 1.3)
        for t, c in counts.items():
            row[t] -= 0.7 * c + 0.4
        t = int(torch.argmax(row))
        want.append(t)
        counts[t] = counts.get(t, 0) + 1
        cur.append(t)
    tokens, _ = await run(engine, tuple(prompt), max_tokens=6, repetition_penalty=1.3, frequency_penalty=0.7,
                          presence_penalty=0.4)
    assert tokens == want


async def test_min_tokens_holds_back_the_end(engine: Any) -> None:
    prompt = ids_of(engine, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    tokens, deltas = await run(engine, prompt, max_tokens=40)
    assert deltas[-1].finish_reason is FinishReason.STOP
    n = len(tokens)
    tokens, deltas = await run(engine, prompt, max_tokens=n + 20, min_tokens=n + 5)
    assert len(tokens) >= n + 5


async def test_a_plain_request_is_unchanged_beside_a_processed_one(engine: Any) -> None:
    prompt = ids_of(engine, "Once upon a time")
    alone, _ = await run(engine, prompt, max_tokens=8)
    both = await asyncio.gather(
        run(engine, prompt, max_tokens=8),
        run(engine, ids_of(engine, "The sky is"), max_tokens=8, logprobs=5, frequency_penalty=2.0,
            logit_bias=((5, 3.0),)),
    )
    assert both[0][0] == alone


@pytest.mark.parametrize("structured", [
    Structured("choice", ("yes", "no")),
    Structured("regex", "[0-9]{3}-[a-z]{2}"),
    Structured("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"], "additionalProperties": False})),
])
async def test_grammars_constrain_the_whole_output(engine: Any, structured: Structured) -> None:
    import re

    import jsonschema

    prompt = ids_of(engine, "Answer:")
    tokens, deltas = await run(engine, prompt, max_tokens=30, temperature=0.9, seed=3, structured=structured)
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason is FinishReason.STOP, text
    if structured.kind == "choice":
        assert text in structured.value
    elif structured.kind == "regex":
        assert re.fullmatch(str(structured.value), text)
    else:
        jsonschema.validate(json.loads(text), json.loads(str(structured.value)))


async def test_process_applies_each_rule_to_a_copy() -> None:
    import torch

    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(logit_bias=((3, 1.5),), repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25, min_tokens=2)
    out = logits_ops.process(row, p, generated=[2], counts={2: 1}, prompt_ids=[0, 1], eos_ids=[3])
    # bias 3 -> 2.0, then min_tokens masks eos 3; repetition over {0, 1, 2}: 2/2, -2*2, 1/2; then 2 -= 0.5 + 0.25
    assert out.tolist() == [1.0, -4.0, -0.25, float("-inf")]
    assert row.tolist() == [2.0, -2.0, 1.0, 0.5]
    lp = logits_ops.token_logprob(row, 1, 2)
    assert [t for t, _ in lp.top] == [0, 2, 1]  # the top 2, then the chosen token

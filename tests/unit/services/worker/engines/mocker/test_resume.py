"""A resumed generation on the mocker and echo engines (a stream migrated from a lost worker): resumed after any
number of tokens, the continuation is exactly the rest of the undisturbed output, for token ids, embedding rows and
a seed; the resumed tokens are held in the cache after the prompt; the worker's checks count them."""

from __future__ import annotations

import numpy as np
import pytest

from embedmesh.core.errors import FailedPrecondition, InvalidArgument
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import EmbedsSegment, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.echo.engine import EchoEngine
from embedmesh.services.worker.engines.mocker.config import MockerOptions
from embedmesh.services.worker.engines.mocker.engine import MockerEngine
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.services.worker.validate import check_generation
from embedmesh.worker.v1 import worker_pb2

PROMPTS = {
    "ids": [TokenSegment(tuple(range(37)))],
    "rows": [EmbedsSegment(np.linspace(-1, 1, 5 * 576, dtype=np.float32).reshape(5, 576)), TokenSegment((3, 4))],
}


async def _ids(e: MockerEngine, segments: list, n: int, resumed: tuple[int, ...] = (), seed: int | None = None,
               rid: str = "r") -> list[int]:
    req = GenerationRequest(rid, segments, SamplingParams(max_tokens=n, seed=seed), resumed=resumed)
    out = [d async for d in e.generate(req)]
    assert out[-1].completion_tokens == n  # counts only what it generated
    assert "".join(d.text for d in out) == "".join(f" {t}" for d in out for t in d.token_ids)
    return [t for d in out for t in d.token_ids]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("seed", [None, 5])
async def test_mocker_continues_exactly_after_any_cut(kind: str, seed: int | None) -> None:
    o = MockerOptions(mocker_decode_ms=0.0, mocker_decode_ms_per_seq=0.0, mocker_prefill_ms_per_token=0.0)
    first, second = MockerEngine("m", 16, o), MockerEngine("m", 16, o)  # the lost worker and the one resuming
    await first.start()
    await second.start()
    full = await _ids(first, PROMPTS[kind], 12, seed=seed)
    assert len(set(full)) > 6  # not a constant stream: equality below is the continuation's doing
    for cut in (1, 5, 11):
        rest = await _ids(second, PROMPTS[kind], 12 - cut, tuple(full[:cut]), seed, rid=f"c{cut}")
        assert full[:cut] + rest == full
    await first.shutdown()
    await second.shutdown()


@pytest.mark.asyncio
async def test_mocker_holds_the_resumed_tokens_after_the_prompt() -> None:
    o = MockerOptions(mocker_decode_ms=0.0, mocker_decode_ms_per_seq=0.0, mocker_prefill_ms_per_token=1.0)
    e = MockerEngine("m", 16, o)
    await e.start()
    await _ids(e, PROMPTS["ids"], 2, tuple(range(100, 130)))
    assert e.counters["prompt_tokens"] == 37 + 30 and e.counters["prefilled_tokens"] == 67
    await e.shutdown()


@pytest.mark.asyncio
async def test_echo_generates_only_what_is_left() -> None:
    e = EchoEngine(hidden_size=4)
    req = GenerationRequest("r", [TokenSegment((1, 2))], SamplingParams(max_tokens=3), resumed=(87, 87))
    out = [d async for d in e.generate(req)]
    assert "".join(d.text for d in out) == "xxx" and out[-1].completion_tokens == 3


def test_the_context_and_vocabulary_rules_count_resumed_tokens() -> None:
    info = EchoEngine(hidden_size=4, max_context_tokens=10).info()
    ok = GenerationRequest("r", [TokenSegment((1, 2))], SamplingParams(max_tokens=4), resumed=(5, 6, 7, 8))
    check_generation(ok, info)
    with pytest.raises(InvalidArgument) as e:
        check_generation(GenerationRequest("r", [TokenSegment((1, 2))], SamplingParams(max_tokens=5),
                                           resumed=(5, 6, 7, 8)), info)
    assert e.value.reason == "CONTEXT_OVERFLOW"
    with pytest.raises(InvalidArgument) as e:
        check_generation(GenerationRequest("r", [TokenSegment((1,))], SamplingParams(max_tokens=1),
                                           resumed=(info.vocab_size,)), info)
    assert (e.value.field, e.value.reason) == ("resume_token_ids", "TOKEN_OUT_OF_RANGE")
    with pytest.raises(InvalidArgument) as e:
        check_generation(GenerationRequest("r", [TokenSegment((1,))], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                           resumed=(3,)), info)
    assert e.value.reason == "PROMPT_LOGPROBS_WITH_RESUME"


@pytest.mark.asyncio
async def test_the_servicer_says_which_engines_resume_and_refuses_the_others() -> None:
    class _NoResume(EchoEngine):
        resumes = False

    req = worker_pb2.GenerateRequest(request_id="r", resume_token_ids=[87])
    req.segments.add().token_ids.ids.extend([1, 2])
    req.sampling.max_tokens = 2
    yes = WorkerServicer(EchoEngine(hidden_size=4), "w1")
    assert (await yes.GetInfo(worker_pb2.GetInfoRequest(), None)).resumes_generation
    assert [r.text async for r in yes.generate(req)] != []
    no = WorkerServicer(_NoResume(hidden_size=4), "w2")
    assert not (await no.GetInfo(worker_pb2.GetInfoRequest(), None)).resumes_generation
    with pytest.raises(FailedPrecondition) as e:
        [r async for r in no.generate(req)]
    assert e.value.reason == "RESUME_UNSUPPORTED"
    # SGLang does not resume: a migrated stream never reaches it (the preprocessor picks by GetInfo). vLLM does,
    # refusing per request what it cannot continue exactly (tests/unit/services/worker/engines/vllm/test_resume.py).
    from embedmesh.services.worker.engines.sglang.engine import SGLangEngine
    from embedmesh.services.worker.engines.vllm.engine import VLLMEngine

    assert VLLMEngine.resumes and not SGLangEngine.resumes

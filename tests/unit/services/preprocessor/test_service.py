"""The preprocessor's domain service (service.py) without gRPC: model resolution per served model (base or LoRA
adapter, its own tokenizer), the order of the request rules, and how results are merged per choice (echo, tool
calls, prompt log-probabilities once, usage)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams, sampling_from_proto
from embedmesh.core.transport.received import WireTensor
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.services.preprocessor.chat import ChatTemplate
from embedmesh.services.preprocessor.pipeline import Delta, Job, Usage
from embedmesh.services.preprocessor.prompt_embeds import RawEmbeds
from embedmesh.services.preprocessor.prompts import Prompt, Tokenizer
from embedmesh.services.preprocessor.service import (
    ChatMessageRequest,
    ChatPartRequest,
    ChatRequest,
    Choice,
    CompletionRequest,
    InferenceDomain,
    Limits,
    ServedModels,
)
from embedmesh.services.preprocessor.tools import ToolRequest, ToolSpec
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

HIDDEN = 8


def _info(model: str, task: int = worker_pb2.MODEL_TASK_GENERATE) -> worker_pb2.GetInfoResponse:
    return worker_pb2.GetInfoResponse(model=model, hidden_size=HIDDEN, max_context_tokens=512,
                                      dtype=tensor_pb2.DATA_TYPE_FP32, vocab_size=1000, task=task)


class _Pool:
    """What the domain asks of the worker pool: the served models, adapters, and each model's description."""

    def __init__(self, *infos: worker_pb2.GetInfoResponse, adapters: dict[str, str] | None = None) -> None:
        self.infos = {i.model: i for i in infos}
        self.adapter_bases = adapters or {}

    def models(self) -> dict[str, list[Any]]:
        return {name: [object()] for name in self.infos}

    def known_adapter(self, name: str) -> str | None:
        return self.adapter_bases.get(name)

    def spec(self, model: str) -> worker_pb2.GetInfoResponse:
        if model not in self.infos:
            raise InvalidArgument(f"model {model!r} is not served here", field="model", reason="MODEL_NOT_FOUND")
        return self.infos[model]


class _OtherTokenizer:
    """A second served model's tokenizer, told apart by what it encodes to."""

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return (7,) * len(text)

    def decode(self, ids: Any) -> str:
        return "other"


@pytest.fixture(scope="module")
def folder() -> Any:
    from embedmesh.models import ensure_default_model

    return ensure_default_model()


@pytest.fixture
def domain(folder: Any) -> InferenceDomain:
    pool = _Pool(_info("base"), _info("second"), _info("embedder", worker_pb2.MODEL_TASK_EMBED),
                 adapters={"my-lora": "base"})
    template = ChatTemplate(folder)
    models = ServedModels(pool, Tokenizer(folder), template,  # type: ignore[arg-type]
                          texts={"second": (_OtherTokenizer(), template)})  # type: ignore[dict-item]
    return InferenceDomain(pool, TieredCache(CacheConfig(capacity_bytes=1 << 20)), models,  # type: ignore[arg-type]
                           Limits(max_n=4, max_prompts=3, max_embeds_bytes=1 << 20))


def _sampling(*, echo: bool = False, **kw: Any) -> SamplingParams:
    """Sampling as the servicer hands it to the domain: the request's proto resolved (``echo`` allowing
    ``max_tokens: 0``)."""
    return sampling_from_proto(common_pb2.SamplingParams(**kw), allow_zero_max_tokens=echo)


def _rows(n: int) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[n, HIDDEN],
                             data=np.ones((n, HIDDEN), np.float32).tobytes())


async def _refused(coro: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        await coro
    return e.value


# --- models ---------------------------------------------------------------------------------------------------


async def test_a_lora_adapter_name_runs_on_its_base_model(domain: InferenceDomain) -> None:
    job = await domain.completion_job(CompletionRequest("my-lora", _sampling(), texts=["hi"]))
    assert (job.model, job.adapter, job.base_model, job.served_model) == ("my-lora", "my-lora", "base", "base")
    base = await domain.completion_job(CompletionRequest("base", _sampling(), texts=["hi"]))
    assert (base.adapter, base.base_model, base.served_model) == ("", "", "base")


async def test_each_served_model_tokenizes_with_its_own_tokenizer(domain: InferenceDomain) -> None:
    job = await domain.completion_job(CompletionRequest("second", _sampling(), texts=["abc"]))
    assert job.prompts == [Prompt.of_ids((7, 7, 7))]
    default = await domain.completion_job(CompletionRequest("base", _sampling(), texts=["abc"]))
    assert default.prompts[0].pieces[0] != (7, 7, 7)


@pytest.mark.parametrize(("model", "reason"), [("", "REQUIRED"), ("nope", "MODEL_NOT_FOUND"),
                                               ("embedder", "WRONG_TASK")])
async def test_generation_needs_a_served_generative_model(domain: InferenceDomain, model: str, reason: str) -> None:
    err = await _refused(domain.completion_job(CompletionRequest(model, _sampling(), texts=["hi"])))
    assert (err.field, err.reason) == ("model", reason)


def test_embeddings_need_an_embedding_model(domain: InferenceDomain) -> None:
    assert domain.embedding_model("embedder").info.model == "embedder"
    with pytest.raises(InvalidArgument) as e:
        domain.embedding_model("base")
    assert str(e.value) == "model: 'base' generates text; pick an embedding model (see /v1/models)"


# --- the order of the rules --------------------------------------------------------------------------------------


async def test_the_model_is_checked_before_sampling_and_sampling_before_n(domain: InferenceDomain) -> None:
    # Sampling's ranges are refused by the servicer's conversion (test_servicer.py); the domain keeps the rules that
    # need the model: here a logit_bias token id past the vocabulary of 1000.
    bad_sampling = _sampling(logit_bias={5000: 1.0})
    err = await _refused(domain.completion_job(CompletionRequest("nope", bad_sampling, n=99, texts=["x"])))
    assert err.field == "model"
    err = await _refused(domain.completion_job(CompletionRequest("base", bad_sampling, n=99, texts=["x"])))
    assert (err.field, err.reason) == ("logit_bias", "TOKEN_OUT_OF_RANGE")
    assert str(err) == "logit_bias: token id 5000 is outside the vocabulary [0, 1000)"
    err = await _refused(domain.completion_job(CompletionRequest("base", _sampling(), n=99, texts=["x"])))
    assert (str(err), err.field, err.reason) == ("n must be in [1, 4]", "n", "OUT_OF_RANGE")


async def test_every_raw_tensor_is_read_before_the_prompts_are_counted(domain: InferenceDomain) -> None:
    """A malformed tensor is named even when the request also has too many prompts (as before the split)."""
    broken = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[2, HIDDEN], data=b"\0" * 4)
    request = CompletionRequest("base", _sampling(), texts=["a", "b", "c"],
                                embeds=[RawEmbeds(tensor=WireTensor(_rows(1))), RawEmbeds(tensor=WireTensor(broken))])
    err = await _refused(domain.completion_job(request))
    assert (err.field, err.reason) == ("prompt_embeds[1].data", "DATA_SIZE_MISMATCH")
    empty = CompletionRequest("base", _sampling(), texts=["a"], embeds=[RawEmbeds()])
    err = await _refused(domain.completion_job(empty))
    assert (str(err), err.reason) == ("prompt_embeds: neither tensor nor encoded is set", "REQUIRED")


async def test_embeddings_prompts_refuse_echo_and_prompt_logprobs(domain: InferenceDomain) -> None:
    err = await _refused(domain.completion_job(
        CompletionRequest("base", _sampling(), embeds=[RawEmbeds(tensor=WireTensor(_rows(2)))], echo=True)))
    assert (err.field, err.reason) == ("echo", "ECHO_WITH_EMBEDS")
    err = await _refused(domain.completion_job(
        CompletionRequest("base", _sampling(prompt_logprobs=1), prefix=RawEmbeds(tensor=WireTensor(_rows(2))),
                          texts=["x"])))
    assert (err.field, err.reason) == ("prompt_logprobs", "PROMPT_LOGPROBS_WITH_EMBEDS")


async def test_a_raw_tensor_prompt_becomes_rows_and_the_prefix_goes_first(domain: InferenceDomain) -> None:
    job = await domain.completion_job(CompletionRequest("base", _sampling(max_tokens=4), n=2, texts=["hi"],
                                                        prefix=RawEmbeds(tensor=WireTensor(_rows(3)))))
    assert job.n == 2 and job.request_id.startswith("cmpl-")
    first = job.prompts[0].pieces[0]
    assert isinstance(first, np.ndarray) and first.shape == (3, HIDDEN)
    err = await _refused(domain.completion_job(
        CompletionRequest("base", _sampling(max_tokens=4), embeds=[RawEmbeds(tensor=WireTensor(_rows(509)))])))
    assert str(err) == "prompt_embeds: 509 rows + max_tokens 4 exceed the model's context of 512 positions"


async def test_chat_rules(domain: InferenceDomain) -> None:
    user = ChatMessageRequest("user", [ChatPartRequest(text="hello")])
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(prompt_logprobs=1), [user])))
    assert (err.field, err.reason) == ("prompt_logprobs", "UNSUPPORTED")
    tool = ChatMessageRequest("tool", [ChatPartRequest(text="42")])
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(), [user, tool])))
    assert (str(err), err.field) == ("messages[1].tool_call_id is required for a tool message",
                                     "messages[1].tool_call_id")
    tools = ToolRequest(tools=(("add", "adds", ""),), choice="mode", mode="required")
    structured = _sampling(structured=common_pb2.StructuredOutput(json_object=True))
    err = await _refused(domain.chat_job(ChatRequest("base", structured, [user], tools=tools)))
    assert (err.field, err.reason) == ("tool_choice", "CONFLICT")
    job = await domain.chat_job(ChatRequest("base", _sampling(), [user], tools=tools, request_id="r1"))
    assert job.request_id == "r1" and job.tools is not None and job.sampling.structured is not None
    assert job.sampling.structured.kind == "json_schema"


# --- results -----------------------------------------------------------------------------------------------------


async def test_max_tokens_zero_echo_needs_no_worker(domain: InferenceDomain) -> None:
    request = CompletionRequest("base", _sampling(max_tokens=0, echo=True), n=2, token_prompts=[[1, 2, 3]], echo=True)
    result = await domain.complete(request)
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.finish_reason == common_pb2.FINISH_REASON_LENGTH for c in result.choices)
    assert result.choices[0].text == result.choices[1].text != ""
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 0)
    stream = await domain.stream_complete(request)
    items = [item async for item in stream.items]
    assert stream.id.startswith("cmpl-") and stream.model == "base"
    assert isinstance(items[-1], Usage) and [c.index for c in items[:-1]] == [0, 1]


def _job(**kw: Any) -> Job:
    return Job("id-1", "base", [Prompt.of_ids((1, 2))], _sampling(), kw.pop("n", 1),
               tensor_pb2.DATA_TYPE_FP32, **kw)


def _script(domain: InferenceDomain, items: list[Delta | Usage]) -> None:
    async def fake(job: Job) -> AsyncIterator[Delta | Usage]:
        for item in items:
            yield item

    domain._items = fake  # type: ignore[method-assign]


LP = common_pb2.TokenLogprob(token_id=5, logprob=-0.5)


async def test_collect_merges_deltas_per_choice(domain: InferenceDomain) -> None:
    _script(domain, [Delta(1, "b", (2,), 0, (LP,), (LP,)), Delta(0, "a", (1,), 0), Delta(1, "c", (3,), 0, (), (LP,)),
                     Delta(0, "!", (4,), common_pb2.FINISH_REASON_STOP),
                     Delta(1, "", (), common_pb2.FINISH_REASON_LENGTH), Usage(2, 4)])
    result = await domain._collect(_job(n=2, echo=("P:",)))
    assert [(c.text, list(c.token_ids), c.finish_reason) for c in result.choices] == [
        ("P:a!", [1, 4], common_pb2.FINISH_REASON_STOP), ("P:bc", [2, 3], common_pb2.FINISH_REASON_LENGTH)]
    assert list(result.choices[1].prompt_logprobs) == [LP]  # from the first delta only
    assert (result.id, result.usage) == ("id-1", Usage(2, 4))


async def test_stream_with_tools_sends_each_choice_whole_with_its_calls(domain: InferenceDomain) -> None:
    from embedmesh.services.preprocessor.tools import Tool

    spec = ToolSpec((Tool("add", "", {}),), "auto")
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    _script(domain, [Delta(0, "ok ", (1,), 0), Delta(0, call, (2,), common_pb2.FINISH_REASON_STOP), Usage(2, 2)])
    items = [item async for item in domain._stream(_job(tools=spec))]
    assert len(items) == 2
    choice = items[0]
    assert isinstance(choice, Choice) and choice.text == "ok" and list(choice.token_ids) == [1, 2]
    assert [(c.name, c.arguments) for c in choice.tool_calls] == [("add", '{"a": 1}')]
    assert items[1] == Usage(2, 2)


async def test_stream_puts_echo_before_each_choices_first_delta(domain: InferenceDomain) -> None:
    _script(domain, [Delta(0, "x", (1,), 0), Delta(0, "y", (2,), common_pb2.FINISH_REASON_STOP), Usage(1, 2)])
    items = [item async for item in domain._stream(_job(echo=("E",)))]
    assert [i.text for i in items if isinstance(i, Choice)] == ["Ex", "y"]


async def test_an_image_part_becomes_rows_in_its_place(domain: InferenceDomain) -> None:
    from pathlib import Path

    from embedmesh.vision.decode import ImageLimits
    from embedmesh.vision.stage import ImageSource, VisionStage
    from tests.unit.vision.test_stage import CountingEncoder, png, url

    image = ChatMessageRequest("user", [ChatPartRequest(text="look"), ChatPartRequest(image=url(png(1)))])
    err = await _refused(domain.chat_job(ChatRequest("base", _sampling(max_tokens=4), [image])))
    assert (err.field, err.reason) == ("messages[0].content[1].image_url", "IMAGES_DISABLED")
    domain.vision = VisionStage(domain.cache, limits=ImageLimits(), folder_of=lambda model: Path("/m"),
                                factory=CountingEncoder)
    try:
        job = await domain.chat_job(ChatRequest("base", _sampling(max_tokens=4), [image]))
        rows = [p for p in job.prompts[0].pieces if isinstance(p, np.ndarray)]
        assert len(rows) == 1 and rows[0].shape == (3, HIDDEN)
        raw = ChatMessageRequest("user", [ChatPartRequest(image=ImageSource(data=b"GIF89a"))])
        err = await _refused(domain.chat_job(ChatRequest("base", _sampling(max_tokens=4), [raw])))
        assert (err.field, err.reason) == ("messages[0].content[0].image.data", "FORMAT_NOT_ALLOWED")
    finally:
        domain.vision = None

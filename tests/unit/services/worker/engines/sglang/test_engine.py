"""The sglang engine at its boundary with SGLang, without SGLang running: the ``Engine`` arguments, the
``GenerateReqInput`` / ``EmbeddingReqInput`` objects built from our requests, and the conversion of SGLang's
outputs, against a scripted tokenizer manager. SGLang's generative path needs a GPU, so this boundary is all that is
tested of it; embeddings on the real SGLang (CPU) are tested in tests/e2e_sglang/."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams
from embedmesh.core.tensors import f32_to_bf16
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    TokenSegment,
)
from embedmesh.services.worker.engines.embed_inputs import InputEncoder
from embedmesh.services.worker.engines.sglang.engine import (
    SGLangConfig,
    SGLangEngine,
    delta_from_output,
    engine_kwargs,
    generate_request,
    prompt_fields,
    sampling_to_sglang,
)


@dataclass
class _ReqInput:
    """Stands in for SGLang's request dataclasses when SGLang is not installed (main venv)."""

    rid: Any = None
    text: Any = None
    input_ids: Any = None
    input_embeds: Any = None
    sampling_params: Any = None
    stream: bool = False
    lora_path: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class _LoraReq:
    """Stands in for SGLang's (keyword-only) LoRA load/unload request structs."""

    def __init__(self, *, lora_name: str, lora_path: str = "") -> None:
        self.lora_name, self.lora_path = lora_name, lora_path


@pytest.fixture
def io_struct(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    try:
        from sglang.srt.managers import io_struct as real  # the sglang venv

        yield real
        return
    except ImportError:
        pass
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.GenerateReqInput = type("GenerateReqInput", (_ReqInput,), {})  # type: ignore[attr-defined]
    mod.EmbeddingReqInput = type("EmbeddingReqInput", (_ReqInput,), {})  # type: ignore[attr-defined]
    mod.LoadLoRAAdapterReqInput = _LoraReq  # type: ignore[attr-defined]
    mod.UnloadLoRAAdapterReqInput = _LoraReq  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)
    yield mod


def test_engine_kwargs_for_embeddings_on_the_cpu() -> None:
    kw = engine_kwargs(SGLangConfig(Path("/m"), "all-MiniLM-L6-v2", max_total_tokens=4096), 256)
    assert kw["is_embedding"] is True and kw["device"] == "cpu"
    assert kw["disable_radix_cache"] is True, "a repeated input would come back as a wrong vector"
    assert kw["max_total_tokens"] == 4096 and kw["context_length"] == 256
    assert kw["model_path"] == "/m" and kw["served_model_name"] == "all-MiniLM-L6-v2"
    assert "incremental_streaming_output" not in kw


def test_engine_kwargs_for_generation() -> None:
    kw = engine_kwargs(SGLangConfig(Path("/m"), "smol", task="generate", device="cuda", extra={"tp_size": 2}), None)
    assert "is_embedding" not in kw and kw["incremental_streaming_output"] is True
    assert kw["device"] == "cuda" and kw["tp_size"] == 2 and "context_length" not in kw


@pytest.mark.parametrize("bad", [{"task": "rerank"}, {"max_total_tokens": 0}, {"max_running_requests": 0}])
def test_config_ranges(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SGLangConfig(Path("/m"), "x", **bad)


def test_sampling_mapping() -> None:
    s = sampling_to_sglang(SamplingParams(max_tokens=7, temperature=0.0, top_p=0.9, top_k=0, seed=3,
                                          stop=("\n",), ignore_eos=True))
    assert s == {"max_new_tokens": 7, "temperature": 0.0, "top_p": 0.9, "top_k": -1, "ignore_eos": True,
                 "stop": ["\n"], "sampling_seed": 3}
    assert "stop" not in sampling_to_sglang(SamplingParams()) and sampling_to_sglang(SamplingParams(top_k=5))[
        "top_k"] == 5


def test_openai_surface_mapping() -> None:
    from embedmesh.core.sampling import Structured
    from embedmesh.services.worker.engines.sglang.engine import delta_from_output, logprob_fields

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_tokens=3,
                       logit_bias=((7, -100.0),), structured=Structured("choice", ("a.b", "c")), logprobs=2)
    s = sampling_to_sglang(p)
    assert (s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"], s["min_new_tokens"]) == (
        0.5, -1.0, 1.2, 3)
    assert s["logit_bias"] == {"7": -100.0} and s["regex"] == r"(a\.b|c)"
    assert sampling_to_sglang(SamplingParams(structured=Structured("json_object")))["json_schema"] == \
        '{"type": "object"}'
    assert logprob_fields(p) == {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1}
    assert logprob_fields(SamplingParams()) == {}
    assert logprob_fields(SamplingParams(prompt_logprobs=0))["logprob_start_len"] == 0
    d = delta_from_output({"text": "hi", "output_ids": [5], "meta_info": {
        "completion_tokens": 1, "output_token_logprobs": [(-0.5, 5, None)],
        "output_top_logprobs": [[(-0.1, 9, None), (-0.5, 5, None)]]}})
    assert d.logprobs[0].token_id == 5 and d.logprobs[0].logprob == -0.5
    assert d.logprobs[0].top == ((9, -0.1), (5, -0.5))


TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)


def _table(ids: Any) -> np.ndarray:
    return TABLE[np.asarray(ids)]


def test_token_only_prompts_go_as_input_ids() -> None:
    assert prompt_fields([TokenSegment((1, 2)), TokenSegment((3,))], _table) == {"input_ids": [1, 2, 3]}


def test_prompts_with_embeddings_go_as_input_embeds_in_order() -> None:
    rows = np.full((2, 4), 0.5, np.float32)
    out = prompt_fields([TokenSegment((1, 2)), EmbedsSegment(rows), TokenSegment((3,))], _table)
    assert list(out) == ["input_embeds"]
    np.testing.assert_array_equal(np.array(out["input_embeds"]), np.concatenate([TABLE[[1, 2]], rows, TABLE[[3]]]))


def test_bf16_rows_are_widened() -> None:
    rows = np.array([[1.5, -2.0, 0.25, 3.0]], np.float32)
    out = prompt_fields([EmbedsSegment(f32_to_bf16(rows))], None)
    np.testing.assert_array_equal(np.array(out["input_embeds"], np.float32), rows)


def test_mixed_prompt_without_an_embedding_table_is_a_400() -> None:
    with pytest.raises(InvalidArgument) as info:
        prompt_fields([TokenSegment((1,)), EmbedsSegment(np.zeros((1, 4), np.float32))], None)
    assert info.value.field == "prompt"


def test_generate_request_object(io_struct: Any) -> None:
    req = GenerationRequest("rid-1", [EmbedsSegment(np.ones((3, 4), np.float32))], SamplingParams(max_tokens=5))
    obj = generate_request(req, _table)
    assert isinstance(obj, io_struct.GenerateReqInput)
    assert obj.rid == "rid-1" and obj.stream is True and obj.input_ids is None and obj.text is None
    assert np.array(obj.input_embeds).shape == (3, 4)
    assert obj.sampling_params["max_new_tokens"] == 5


@pytest.mark.parametrize(
    "chunk,expected",
    [
        ({"text": "Hel", "output_ids": [5, 6], "meta_info": {"finish_reason": None, "completion_tokens": 2}},
         ("Hel", (5, 6), 2, None)),
        ({"text": "!", "output_ids": [7],
          "meta_info": {"finish_reason": {"type": "length", "length": 3}, "completion_tokens": 3}},
         ("!", (7,), 3, FinishReason.LENGTH)),
        ({"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                      "completion_tokens": 4}}, ("", (), 4, FinishReason.STOP)),
        ({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}, ("", (), 0, FinishReason.ABORT)),
    ],
)
def test_output_chunks_become_deltas(chunk: dict[str, Any], expected: tuple[Any, ...]) -> None:
    d = delta_from_output(chunk)
    assert (d.text, d.token_ids, d.completion_tokens, d.finish_reason) == expected


class _Manager:
    """A scripted SGLang tokenizer manager: records what it is sent, answers with canned outputs."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        self.sent: list[Any] = []
        self.aborted: list[str] = []

    async def _gen(self) -> AsyncIterator[Any]:
        for o in self.outputs:
            yield o

    def generate_request(self, obj: Any, request: Any) -> AsyncIterator[Any]:
        self.sent.append(obj)
        return self._gen()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)

    # LoRA: SGLang answers LoRAUpdateOutput(success, error_message); a load takes a moment.
    loads: list[tuple[str, str]]
    unloads: list[str]
    fail_path = "bad"

    async def load_lora_adapter(self, obj: Any, request: Any) -> Any:
        self.loads = [*getattr(self, "loads", []), (obj.lora_name, obj.lora_path)]
        await asyncio.sleep(0.01)
        if obj.lora_path == self.fail_path:
            return types.SimpleNamespace(success=False, error_message="no adapter_config.json")
        return types.SimpleNamespace(success=True, error_message=None)

    async def unload_lora_adapter(self, obj: Any, request: Any) -> Any:
        self.unloads = [*getattr(self, "unloads", []), obj.lora_name]
        return types.SimpleNamespace(success=True, error_message=None)


def _engine(task: str, manager: _Manager, *, dims: bool = False, lora: bool = False) -> SGLangEngine:
    e = SGLangEngine(SGLangConfig(Path("/m"), "m", task=task, supports_dimensions=dims, enable_lora=lora))
    e._sgl = types.SimpleNamespace(tokenizer_manager=manager)
    e._info = ModelInfo("m", "sglang", 4, 8, "float32", 100, 8, task=task,
                        embedding_size=4 if task == "embed" else 0, supports_dimensions=dims)

    def tok(text: str, *, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [1, *(10 + len(w) for w in text.split()), 2]}

    e._encoder = InputEncoder(tok, "m", 100, 8) if task == "embed" else None
    e._embed_tokens = _table
    return e


async def test_embed_sends_checked_token_ids_and_keeps_the_order(io_struct: Any) -> None:
    vecs = [[1.0, 0, 0, 0], [0, 1.0, 0, 0]]
    manager = _Manager([[{"embedding": v, "meta_info": {}} for v in vecs]])
    e = _engine("embed", manager)
    out, tokens = await e.embed(["a bb", [1, 7, 2]])
    np.testing.assert_array_equal(out, np.array(vecs, np.float32))
    assert tokens == [4, 3]
    (obj,) = manager.sent
    assert isinstance(obj, io_struct.EmbeddingReqInput)
    assert obj.input_ids == [[1, 11, 12, 2], [1, 7, 2]] and len(obj.rid) == 2


async def test_embed_rules_match_the_hf_worker(io_struct: Any) -> None:
    e = _engine("embed", _Manager([]))
    for inputs, dims, field_name in [([[1, 100]], None, "input"), (["ok", "w " * 20], None, "input[1]"),
                                     (["ok"], 2, "dimensions"), (["ok"], 5, "dimensions")]:
        with pytest.raises(InvalidArgument) as info:
            await e.embed(inputs, dims)
        assert info.value.field == field_name
    shortened = _engine("embed", _Manager([[{"embedding": [3.0, 4.0, 12.0, 0.0], "meta_info": {}}]]), dims=True)
    out, _ = await shortened.embed(["x"], 2)
    np.testing.assert_allclose(out, [[0.6, 0.8]], atol=1e-6)


async def test_generate_streams_deltas(io_struct: Any) -> None:
    manager = _Manager([
        {"text": "a", "output_ids": [5], "meta_info": {"finish_reason": None, "completion_tokens": 1}},
        {"text": "b", "output_ids": [6], "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 2}},
    ])
    e = _engine("generate", manager)
    req = GenerationRequest("r1", [TokenSegment((1, 2)), EmbedsSegment(np.zeros((2, 4), np.float32))],
                            SamplingParams(max_tokens=2))
    deltas = [d async for d in e.generate(req)]
    assert [d.text for d in deltas] == ["a", "b"] and deltas[-1].finish_reason is FinishReason.LENGTH
    assert np.array(manager.sent[0].input_embeds).shape == (4, 4)
    assert manager.aborted == [] and e.stats().completed_requests == 1


async def test_closing_the_stream_early_aborts_in_sglang(io_struct: Any) -> None:
    manager = _Manager([{"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}] * 5)
    e = _engine("generate", manager)
    stream = e.generate(GenerationRequest("r2", [TokenSegment((1,))]))
    first = await stream.__anext__()  # type: ignore[attr-defined]
    assert first.text == "a"
    await stream.aclose()  # type: ignore[attr-defined]
    assert manager.aborted == ["r2"]


async def test_wrong_task_is_a_400(io_struct: Any) -> None:
    with pytest.raises(InvalidArgument):
        await _engine("generate", _Manager([])).embed(["x"])
    with pytest.raises(InvalidArgument):
        [d async for d in _engine("embed", _Manager([])).generate(GenerationRequest("r", [TokenSegment((1,))]))]


def test_engine_kwargs_with_lora() -> None:
    kw = engine_kwargs(SGLangConfig(Path("/m"), "smol", task="generate", enable_lora=True, max_lora_rank=8,
                                    max_loras_per_batch=3), None)
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 8 and kw["max_loras_per_batch"] == 3
    assert kw["lora_target_modules"] == ["all"]
    assert "enable_lora" not in engine_kwargs(SGLangConfig(Path("/m"), "smol", task="generate"), None)
    with pytest.raises(ValueError):
        SGLangConfig(Path("/m"), "e", task="embed", enable_lora=True)


async def test_lora_load_once_generate_with_it_unload(io_struct: Any) -> None:
    manager = _Manager([{"text": "a", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"},
                                                                       "completion_tokens": 1}}])
    e = _engine("generate", manager, lora=True)
    loaded = await asyncio.gather(*[e.load_lora("sql", "/root/sql") for _ in range(4)])
    assert sorted(loaded) == [False, False, False, True] and manager.loads == [("sql", "/root/sql")]
    assert await e.list_loras() == {"sql": "/root/sql"} and e.lora_names() == ["sql"]
    req = GenerationRequest("r1", [TokenSegment((1, 2))], SamplingParams(max_tokens=1), lora_adapter="sql")
    assert [d.text async for d in e.generate(req)] == ["a"]
    assert manager.sent[-1].lora_path == "sql", "SGLang resolves a loaded adapter by its name"
    base = generate_request(GenerationRequest("r2", [TokenSegment((1,))]), None)
    assert getattr(base, "lora_path", None) is None
    assert await e.unload_lora("sql") is True and manager.unloads == ["sql"]
    assert await e.unload_lora("sql") is False
    with pytest.raises(InvalidArgument) as info:
        [d async for d in e.generate(GenerationRequest("r3", [TokenSegment((1,))], lora_adapter="sql"))]
    assert info.value.field == "model" and info.value.reason == "LORA_NOT_LOADED"


async def test_lora_refusals(io_struct: Any) -> None:
    from embedmesh.core.errors import FailedPrecondition

    e = _engine("generate", _Manager([]), lora=True)
    with pytest.raises(InvalidArgument) as info:
        await e.load_lora("x", "bad")
    assert info.value.field == "path" and "adapter_config.json" in info.value.message
    assert e.lora_names() == [], "nothing half-loaded"
    with pytest.raises(FailedPrecondition):
        await _engine("generate", _Manager([])).load_lora("x", "/root/x")

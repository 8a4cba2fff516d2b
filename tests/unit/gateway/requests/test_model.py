"""The typed request models (gateway/requests/ and the vector-store models): each route's body refuses a wrong
type, a missing required field and an out-of-range value with the exact 400 (message, param, code) and accepts
what it must; the first refusal does not depend on the JSON key order; the models' fast path (msgspec) and their
field-by-field walk refuse the same bodies; temperature above core's maximum reads as core's own refusal."""

from __future__ import annotations

import base64
import os
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import TEMPERATURE_MAX, sampling_from_proto
from embedmesh.gateway import embeds_json, vector_stores
from embedmesh.gateway.embeddings import embed_request
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import (
    ChatRequest,
    CompletionRequest,
    EmbeddingsRequest,
    LoadLoraRequest,
    PromptEmbedsUpload,
    UnloadLoraRequest,
    parse,
)
from embedmesh.gateway.requests.model import _walk
from embedmesh.gateway.translate import chat_params, completion_params
from tests.support.fuzz import fuzz_settings

B64 = base64.b64encode(b"\x00\x01\x02").decode()
COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(model: type, body: dict[str, Any]) -> tuple[int, str, str | None, str | None]:
    with pytest.raises(ApiError) as e:
        parse(model, body)
    return e.value.status, e.value.message, e.value.param, e.value.code


REFUSED = [
    # (model, body, message, param, code): a wrong type, a missing required field, an out-of-range value per route
    (CompletionRequest, {**COMPLETION, "temperature": "hot"}, "temperature: must be a number >= 0", "temperature",
     "invalid_value"),
    (CompletionRequest, {"prompt": "hi"}, "model: is required (a served model name; see GET /v1/models)", "model",
     "missing"),
    (CompletionRequest, {**COMPLETION, "top_p": 1.5}, "top_p: must be a number in (0, 1]", "top_p", "invalid_value"),
    (CompletionRequest, {**COMPLETION, "max_tokens": "8"}, "max_tokens: must be an integer >= 1", "max_tokens",
     "invalid_type"),
    (CompletionRequest, {**COMPLETION, "max_tokens": 0}, "max_tokens: must be an integer >= 1", "max_tokens",
     "invalid_value"),
    (CompletionRequest, {**COMPLETION, "echo": True, "max_tokens": -1}, "max_tokens: must be an integer >= 0",
     "max_tokens", "invalid_value"),
    (CompletionRequest, {**COMPLETION, "logprobs": 21}, "logprobs: must be an integer in [0, 20]", "logprobs",
     "invalid_value"),
    (CompletionRequest, {**COMPLETION, "stop": ["x"] * 17}, "stop: at most 16 stop strings", "stop", "invalid_value"),
    (CompletionRequest, {**COMPLETION, "best_of": 2}, "best_of: is not supported by this server: only 1 is accepted "
     "(use n)", "best_of", "unsupported_parameter"),
    (CompletionRequest, {**COMPLETION, "store": True}, "store: is not supported by this server: it stores no "
     "completions (only false is accepted)", "store", "unsupported_parameter"),
    (CompletionRequest, {**COMPLETION, "prompt_embeds": ["!!"]}, "prompt_embeds: is not valid base64 (standard "
     "alphabet, with padding)", "prompt_embeds", "invalid_base64"),
    (CompletionRequest, {**COMPLETION, "prompt_embeds": [B64, {"id": ""}]}, "prompt_embeds[1].id: must be the id "
     "returned by POST /v1/prompt_embeds", "prompt_embeds[1].id", "missing"),
    (CompletionRequest, {**COMPLETION, "prompt": [[1], [2**31]]}, "prompt[1]: token ids must be integers in [0, "
     "vocabulary size)", "prompt[1]", "invalid_value"),
    (CompletionRequest, {**COMPLETION, "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice: cannot be "
     "combined with guided_regex: give one output constraint", "guided_choice", "invalid_value"),
    (CompletionRequest, {**COMPLETION, "colour": 1}, "colour: is not a parameter this server knows; remove it (see "
     "docs/openai-fields.md for the accepted ones)", "colour", "unknown_parameter"),
    (ChatRequest, {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be a string or "
     "a list of content parts", "messages[0].content", "invalid_type"),
    (ChatRequest, {**CHAT, "messages": [{"content": "hi"}]}, "messages[0].role: is required", "messages[0].role",
     "missing"),
    (ChatRequest, {"model": "m"}, "messages: must be a non-empty list of messages", "messages", "invalid_value"),
    (ChatRequest, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs: must be an integer in [0, 20]",
     "top_logprobs", "invalid_value"),
    (ChatRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "input_audio"}]}]},
     "messages[0].content[1].type: unsupported content part type 'input_audio'; this server accepts 'text', "
     "'prompt_embeds' and 'image_url'", "messages[0].content[1].type", "unsupported_type"),
    (ChatRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "image_url"}]}]},
     'messages[0].content[1].image_url: must be an object {"url": "data:image/png;base64,..."} (PNG, JPEG or WebP)',
     "messages[0].content[1].image_url", "missing"),
    (ChatRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url: is required: a data: URL (data:image/png;base64,...) or an http(s) URL",
     "messages[0].content[0].image_url.url", "missing"),
    (ChatRequest, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:x", "detail": "max"}}]}]},
     "messages[0].content[0].image_url.detail: must be one of ['auto', 'low', 'high']",
     "messages[0].content[0].image_url.detail", "invalid_value"),
    (ChatRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "prompt_embeds"}]}]},
     "messages[0].content[0].data: is required for a prompt_embeds part (base64 of torch.save(tensor)), or give the "
     "id of an upload", "messages[0].content[0].data", "missing"),
    (ChatRequest, {**CHAT, "messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id: is required "
     "for a tool message: the id of the call it answers", "messages[0].tool_call_id", "missing"),
    (ChatRequest, {**CHAT, "tools": [{"function": {"name": "bad name"}}]}, "tools[0].function.name: is required: "
     "1-64 letters, digits, '_' or '-'", "tools[0].function.name", "invalid_value"),
    (ChatRequest, {**CHAT, "tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]},
     "tools[1].function.name: 'f' is given twice", "tools[1].function.name", "invalid_value"),
    (ChatRequest, {**CHAT, "tools": [{"function": {"name": "f"}}, {"function": {"name": "f", "description": 5}}]},
     "tools[1].function.name: 'f' is given twice", "tools[1].function.name", "invalid_value"),  # before the rest
    (ChatRequest, {**CHAT, "tools": [5]}, 'tools[0].type: must be "function"', "tools[0].type", "invalid_value"),
    (ChatRequest, {**CHAT, "tool_choice": "required"}, "tool_choice: 'required' needs tools", "tool_choice",
     "invalid_value"),
    (ChatRequest, {**CHAT, "max_tokens": 0}, "max_tokens: must be an integer >= 1", "max_tokens", "invalid_value"),
    (ChatRequest, {**CHAT, "audio": {}}, "audio: is not supported by this server: it generates text only", "audio",
     "unsupported_parameter"),
    (EmbeddingsRequest, {"model": "e", "input": {}}, "input: must be a string, a list of strings, a list of token "
     "ids or a list of token-id lists", "input", "invalid_type"),
    (EmbeddingsRequest, {"input": "x"}, "model: is required (an embedding model; see GET /v1/models)", "model",
     "missing"),
    (EmbeddingsRequest, {"model": "e", "input": "x", "dimensions": 0}, "dimensions: must be a positive integer",
     "dimensions", "invalid_value"),
    (EmbeddingsRequest, {"model": "e", "input": "x", "encoding_format": "hex"}, "encoding_format: must be 'float' "
     "or 'base64', got 'hex'", "encoding_format", "invalid_value"),
    (LoadLoraRequest, {"lora_name": 5, "lora_path": "/p"}, "lora_name: is required (a non-empty string)",
     "lora_name", "invalid_type"),
    (LoadLoraRequest, {"lora_name": "a"}, "lora_path: is required (a non-empty string)", "lora_path", "missing"),
    (LoadLoraRequest, {"lora_name": "a", "lora_path": "/p", "workers": "w1"}, "workers: must be a list of worker "
     "ids (see /health)", "workers", "invalid_type"),
    (LoadLoraRequest, {"lora_name": "a", "lora_path": "/p", "rank": 8}, "rank: is not a parameter of this route",
     "rank", "unknown_parameter"),
    (UnloadLoraRequest, {}, "lora_name: is required (a non-empty string)", "lora_name", "missing"),
    (PromptEmbedsUpload, {}, "data: must be a base64 string, got NoneType", "data", "invalid_type"),
    (PromptEmbedsUpload, {"data": 5}, "data: must be a base64 string, got int", "data", "invalid_type"),
    (PromptEmbedsUpload, {"data": "QUJ"}, "data: is not valid base64 (standard alphabet, with padding)", "data",
     "invalid_base64"),
    (PromptEmbedsUpload, {"ttl_seconds": 0, "data": "%%"}, "data: is not valid base64 (standard alphabet, with "
     "padding)", "data", "invalid_base64"),
    (PromptEmbedsUpload, {"data": B64, "ttl_seconds": 0}, "ttl_seconds: must be an integer >= 1", "ttl_seconds",
     "invalid_value"),
    (PromptEmbedsUpload, {"data": B64, "ttl_seconds": True}, "ttl_seconds: must be an integer >= 1", "ttl_seconds",
     "invalid_value"),
    (PromptEmbedsUpload, {"data": B64, "ttl_seconds": 1.0}, "ttl_seconds: must be an integer >= 1", "ttl_seconds",
     "invalid_value"),
    (PromptEmbedsUpload, {"data": B64, "ttl_seconds": "60"}, "ttl_seconds: must be an integer >= 1", "ttl_seconds",
     "invalid_value"),
    (PromptEmbedsUpload, {"data": B64, "ttl_seconds": -(2**63)}, "ttl_seconds: must be an integer >= 1",
     "ttl_seconds", "invalid_value"),
    (vector_stores.Search, {"query": 5}, "query: must be a string or a list of strings", "query", "invalid_type"),
    (vector_stores.Search, {}, "query: must be a string or a list of strings", "query", "invalid_type"),
    (vector_stores.Search, {"query": "q", "max_num_results": 2**32}, f"max_num_results: must be an integer in [1, "
     f"50], got {2**32}", "max_num_results", "invalid_value"),
    (vector_stores.Search, {"query": "q", "filters": {"type": "and", "filters": [{"type": "eq", "key": "k"}]}},
     "filters.filters[0].value: is required", "filters.filters[0].value", "missing"),
    (vector_stores.Search, {"query": "q", "ranking_options": {"score_threshold": "high"}},
     "ranking_options.score_threshold: must be a number", "ranking_options.score_threshold", "invalid_type"),
    (vector_stores.AddFile, {}, "file_id: is required", "file_id", "missing"),
    (vector_stores.AddFile, {"file_id": "f", "chunking_strategy": {"type": "static", "static": {
        "max_chunk_size_tokens": -1}}}, "chunking_strategy.static.max_chunk_size_tokens: must be a non-negative "
     "integer, got -1", "chunking_strategy.static.max_chunk_size_tokens", "invalid_type"),
    (vector_stores.AddFile, {"file_id": "f", "chunking_strategy": {"type": "smart"}}, "chunking_strategy.type: must "
     "be 'auto' or 'static', got 'smart'", "chunking_strategy.type", "invalid_value"),
    (vector_stores.UpdateFile, {}, "attributes: is required", "attributes", "missing"),
    (vector_stores.CreateStore, {"name": 5}, "name: must be a string", "name", "invalid_type"),
    (vector_stores.CreateStore, {"expires_after": {"anchor": "last_active_at"}}, "expires_after.days: must be a "
     "non-negative integer, got None", "expires_after.days", "invalid_type"),
    (vector_stores.ModifyStore, {"metadata": {"team": 1}}, "metadata.team: values must be strings", "metadata.team",
     "invalid_type"),
    (vector_stores.CreateBatch, {"files": [{"file_id": "a"}, {"file_id": "b", "attributes": {"k": [1]}}]},
     "files[1].attributes.k: must be a string, number or boolean, got list", "files[1].attributes.k",
     "invalid_type"),
    (vector_stores.CreateBatch, {"files": [3]}, "files[0]: must be an object", "files[0]", "invalid_type"),
]


@pytest.mark.parametrize("model,body,message,param,code", REFUSED,
                         ids=[f"{m.__name__}:{p}:{i}" for i, (m, _, _, p, _) in enumerate(REFUSED)])
def test_each_model_refuses_with_the_exact_400(model: type, body: dict[str, Any], message: str, param: str,
                                               code: str) -> None:
    assert refusal(model, body) == (400, message, param, code)


def test_each_model_accepts_a_full_body() -> None:
    c = completion_params({**COMPLETION, "max_tokens": 0, "echo": True, "temperature": TEMPERATURE_MAX, "top_p": 1,
                           "top_k": -1, "seed": -5, "stop": ["a", ""], "n": 2, "logit_bias": {"7": -100},
                           "response_format": {"type": "json_object"}, "logprobs": 2, "prompt_embeds": [B64],
                           "prompt_embeds_prefix": {"id": "emb-1"}, "stream_options": {"include_usage": True},
                           "store": False, "min_p": 0, "suffix": "", "best_of": 1, "user": "u"})
    assert (c.sampling.max_tokens, c.sampling.temperature, c.sampling.HasField("top_k"), list(c.sampling.stop)) == \
        (0, TEMPERATURE_MAX, False, ["a"])
    assert dict(c.sampling.logit_bias) == {7: -100.0} and c.sampling.structured.json_object and c.n == 2
    assert c.prompts == ["hi"] and c.prompt_embeds[0].encoded.data == b"\x00\x01\x02"
    assert c.prefix.cache_id == "emb-1"
    chat = chat_params({**CHAT, "max_completion_tokens": 3, "max_tokens": "ignored beside max_completion_tokens",
                        "logprobs": True, "top_logprobs": 2,
                        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                        "tool_choice": {"type": "function", "function": {"name": "f"}},
                        "messages": [{"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": [
                                {"type": "text", "text": "r"}, {"type": "prompt_embeds", "data": B64}]}]})
    assert chat.sampling.max_tokens == 3 and chat.sampling.logprobs == 2 and chat.tool_choice.function == "f"
    assert chat.tools[0].parameters_json == '{"type":"object"}'
    assert chat.messages[0].tool_calls[0].id == "c1" and chat.messages[1].tool_call_id == "c1"
    assert chat.messages[1].parts[1].prompt_embeds.encoded.data == b"\x00\x01\x02"
    req, fmt = embed_request({"model": "e", "input": [[1, 2], [3]], "encoding_format": None, "dimensions": 8})
    assert (len(req.inputs), fmt, req.dimensions) == (2, "float", 8)
    load = parse(LoadLoraRequest, {"lora_name": "a", "lora_path": "/p", "workers": None, "load_inplace": True})
    assert (load.lora_name, load.lora_path, load.workers) == ("a", "/p", [])
    search = parse(vector_stores.Search, {"query": ["a", "b"], "filters": {"type": "eq", "key": "k", "value": 1},
                                          "ranking_options": {"score_threshold": 1}, "extra": "ignored"})
    assert search.filters.comparison.key == "k" and search.ranking_options.score_threshold == 1.0
    batch = parse(vector_stores.CreateBatch, {"files": [{"file_id": "a", "attributes": {"x": True},
                                                         "chunking_strategy": {"type": "auto"}}]})
    assert batch.files[0].attributes["x"].bool_value and batch.files[0].chunking_strategy.proto().HasField(
        "auto_chunking")
    upload = parse(PromptEmbedsUpload, {"data": B64, "ttl_seconds": 2**64 - 1, "unknown": "ignored"})
    assert (upload.data, upload.ttl_seconds) == (b"\x00\x01\x02", 2**64 - 1)
    assert parse(PromptEmbedsUpload, {"data": B64, "ttl_seconds": None}).ttl_seconds is None
    modify = parse(vector_stores.ModifyStore, {"expires_after": None})
    assert modify.expires_after is None and modify.metadata is msgspec.UNSET


def core_refusal(temperature: float) -> str:
    with pytest.raises(InvalidArgument) as e:
        sampling_from_proto(common_pb2.SamplingParams(temperature=temperature))
    assert e.value.field == "temperature" and e.value.reason == "OUT_OF_RANGE"
    return e.value.message


@pytest.mark.parametrize("value", [150, 100.5, 1e300])
def test_temperature_above_cores_maximum_reads_as_cores_own_refusal(value: float) -> None:
    """Before the models, the gateway let these through and the preprocessor refused them: the client saw core's
    INVALID_ARGUMENT as 400 "temperature must be in [0, 100]" naming temperature, code out_of_range. Now the
    gateway refuses them itself, with that very answer."""
    assert refusal(CompletionRequest, {**COMPLETION, "temperature": value}) == \
        (400, core_refusal(value), "temperature", "out_of_range")
    assert refusal(ChatRequest, {**CHAT, "temperature": value})[1:] == (core_refusal(value), "temperature",
                                                                          "out_of_range")


def test_the_first_refusal_does_not_depend_on_the_key_order() -> None:
    """msgspec meets the fields in the body's order; the 400 is the first in the model's order either way."""
    bad = {"stop": 5, "temperature": -1}  # temperature comes first in the model
    for body in ({**COMPLETION, **bad}, {**COMPLETION, **dict(reversed(bad.items()))}):
        assert refusal(CompletionRequest, body)[2] == "temperature"


def test_a_base64_string_read_by_the_fast_path_is_not_decoded_again() -> None:
    data = os.urandom(3 << 19)
    raw = orjson.dumps({**COMPLETION, "prompt": "", "prompt_embeds": base64.b64encode(data).decode()})
    body = embeds_json.loads(raw, embeds_json.completion_slots)
    assert body is not None and type(body["prompt_embeds"]) is embeds_json.Base64Text
    blobs: list[bytes] = []
    params = completion_params(body, blobs)
    assert blobs == [data] and blobs[0] is body["prompt_embeds"].decoded
    assert len(params.prompt_embeds) == 1 and params.prompts == []


# Bodies near the valid ones: each field from a pool of good and hostile values.
_VALUES = st.sampled_from([None, True, False, 0, 1, -1, 1.5, 150, 2**32, 2**70, "", "x", "text", "auto", B64, "!!",
                           [], ["a"], [1], [[1]], ["a"] * 17, {}, {"type": "text"}, {"type": "json_object"},
                           {"id": "e"}, {"role": "user", "content": "x"}, [{"role": "user"}],
                           [{"type": "function", "function": {"name": "f"}}], {"include_usage": 1}, {"5": 101}])
_FIELDS = {
    CompletionRequest: ["max_tokens", "temperature", "top_k", "stop", "stream_options", "logit_bias", "echo",
                        "response_format", "guided_regex", "prompt", "prompt_embeds", "best_of", "min_p", "colour"],
    ChatRequest: ["max_tokens", "max_completion_tokens", "temperature", "logprobs", "top_logprobs", "tools",
                  "tool_choice", "messages", "functions", "audio", "structured_outputs"],
    EmbeddingsRequest: ["input", "encoding_format", "dimensions", "model"],
    vector_stores.Search: ["query", "filters", "max_num_results", "ranking_options", "rewrite_query"],
    vector_stores.CreateBatch: ["file_ids", "attributes", "chunking_strategy", "files"],
    PromptEmbedsUpload: ["data", "ttl_seconds", "colour"],
}
_BASES = {CompletionRequest: COMPLETION, ChatRequest: CHAT, EmbeddingsRequest: {"model": "e", "input": "x"},
          vector_stores.Search: {"query": "q"}, vector_stores.CreateBatch: {}, PromptEmbedsUpload: {"data": B64}}


@fuzz_settings(300)
@given(st.sampled_from(list(_FIELDS)).flatmap(
    lambda m: st.tuples(st.just(m), st.dictionaries(st.sampled_from(_FIELDS[m]), _VALUES, max_size=3))))
def test_the_fast_path_and_the_walk_refuse_the_same_bodies(case: tuple[type, dict[str, Any]]) -> None:
    model, fields = case
    body = {**_BASES[model], **fields}
    try:
        msgspec.convert(body, model)
        refused = False
    except msgspec.ValidationError:
        refused = True
    error = _walk(model, body, "")
    assert refused == (error is not None), (body, error and error.message)
    if error is not None:
        assert error.status == 400 and error.param and error.message.startswith(error.param)

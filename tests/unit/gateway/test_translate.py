"""gateway/translate.py: checked OpenAI bodies -> CompletionParams / ChatParams, every field mapped (compared with
messages written by hand), the neutral values that set nothing, embeddings as bytes or as blob placeholders, the
finish reasons, usage and the body-is-an-object rule."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from embedmesh.common.v1 import common_pb2 as cpb
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.translate import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FINISH,
    chat_params,
    completion_params,
    require_object,
    usage_json,
)
from embedmesh.gateway.wire_body import placeholder
from embedmesh.inference.v1 import inference_pb2 as ipb
from embedmesh.tensor.v1 import tensor_pb2

A, B = b"\x80\x02tensor A", b"tensor B bytes"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encoded(data: bytes) -> ipb.PromptEmbeds:
    return ipb.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=data))


def test_a_completion_body_with_every_field_maps_to_its_message() -> None:
    body = {"model": "m", "prompt": ["one", "two"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.25, "top_k": 40,
            "seed": -3, "stop": ["END", ""], "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.25, "min_tokens": 2, "logit_bias": {"11": 5, "12": -100},
            "response_format": {"type": "json_object"}, "n": 3, "echo": True, "logprobs": 4, "prompt_logprobs": 1,
            "prompt_embeds": [b64(A), {"id": "emb-7"}], "prompt_embeds_prefix": b64(B), "user": "ignored"}
    expected = ipb.CompletionParams(
        model="m", prompts=["one", "two"], n=3, echo=True,
        prompt_embeds=[encoded(A), ipb.PromptEmbeds(cache_id="emb-7")], prefix=encoded(B),
        sampling=cpb.SamplingParams(
            max_tokens=7, temperature=0.5, top_p=0.25, top_k=40, seed=-3, stop=["END"], ignore_eos=True,
            presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25, min_tokens=2,
            logit_bias={11: 5.0, 12: -100.0}, logprobs=4, prompt_logprobs=1,
            structured=cpb.StructuredOutput(json_object=True)))
    assert completion_params(body) == expected


@pytest.mark.parametrize(("prompt", "texts", "ids"), [
    ("hi", ["hi"], []),
    ([5, 6], [], [[5, 6]]),
    ([[5], [6, 7]], [], [[5], [6, 7]]),
])
def test_each_prompt_form(prompt: Any, texts: list[str], ids: list[list[int]]) -> None:
    assert completion_params({"model": "m", "prompt": prompt}) == ipb.CompletionParams(
        model="m", prompts=texts, prompt_token_ids=[ipb.TokenIds(ids=x) for x in ids], sampling=cpb.SamplingParams())


def test_neutral_values_set_nothing() -> None:
    """top_k -1 and 0, penalties 0, repetition 1, min_tokens 0, an empty stop: the proto's fields stay unset."""
    params = completion_params({"model": "m", "prompt": "x", "top_k": -1, "presence_penalty": 0,
                                "frequency_penalty": 0, "repetition_penalty": 1, "min_tokens": 0, "stop": "",
                                "logit_bias": {}})
    assert params == ipb.CompletionParams(model="m", prompts=["x"], sampling=cpb.SamplingParams())
    assert not params.sampling.HasField("top_k") and not params.HasField("n")
    assert completion_params({"model": "m", "prompt": "x", "top_k": 0}).sampling == cpb.SamplingParams()


@pytest.mark.parametrize(("fields", "structured"), [
    ({"structured_outputs": {"regex": "a+"}}, cpb.StructuredOutput(regex="a+")),
    ({"guided_choice": ["a", "b"]}, cpb.StructuredOutput(choice=cpb.Choices(values=["a", "b"]))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     cpb.StructuredOutput(json_schema='{"type":"object"}')),
])
def test_structured_outputs_map_to_their_kind(fields: dict[str, Any], structured: cpb.StructuredOutput) -> None:
    assert completion_params({"model": "m", "prompt": "x", **fields}).sampling.structured == structured


def test_with_blobs_embeddings_bytes_go_to_the_list_and_the_message_holds_placeholders() -> None:
    blobs: list[bytes] = []
    params = completion_params({"model": "m", "prompt": "", "prompt_embeds": [b64(A), {"id": "emb-1"}],
                                "prompt_embeds_prefix": b64(B)}, blobs)
    assert blobs == [A, B]
    assert list(params.prompt_embeds) == [encoded(placeholder(0)), ipb.PromptEmbeds(cache_id="emb-1")]
    assert params.prefix == encoded(placeholder(1))
    assert params.prompts == []  # prompt "" beside prompt_embeds is dropped


def test_a_chat_body_with_every_field_maps_to_its_message() -> None:
    body = {"model": "c", "max_completion_tokens": 9, "max_tokens": 99, "temperature": 0, "seed": 1, "n": 2,
            "logprobs": True, "top_logprobs": 3, "stop": "STOP",
            "tools": [{"type": "function", "function": {"name": "get", "description": "d",
                                                        "parameters": {"type": "object"}, "strict": True}},
                      {"type": "function", "function": {"name": "put"}}],
            "tool_choice": "required",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "name": "ann", "content": [{"type": "text", "text": "look:"},
                                                            {"type": "prompt_embeds", "data": b64(A)},
                                                            {"type": "prompt_embeds", "id": "emb-2"}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]}
    expected = ipb.ChatParams(
        model="c", n=2,
        sampling=cpb.SamplingParams(max_tokens=9, temperature=0, seed=1, stop=["STOP"], logprobs=3),
        tools=[ipb.Tool(name="get", description="d", parameters_json='{"type":"object"}', strict=True),
               ipb.Tool(name="put")],
        tool_choice=ipb.ToolChoice(mode="required"),
        messages=[
            ipb.ChatMessage(role="system", parts=[ipb.ChatContentPart(text="be brief")]),
            ipb.ChatMessage(role="user", name="ann", parts=[
                ipb.ChatContentPart(text="look:"), ipb.ChatContentPart(prompt_embeds=encoded(A)),
                ipb.ChatContentPart(prompt_embeds=ipb.PromptEmbeds(cache_id="emb-2"))]),
            ipb.ChatMessage(role="assistant", tool_calls=[ipb.ToolCall(id="c1", name="get", arguments="{}")]),
            ipb.ChatMessage(role="tool", tool_call_id="c1", parts=[ipb.ChatContentPart(text="42")])])
    assert chat_params(body) == expected


def test_chat_max_tokens_logprobs_and_a_named_function() -> None:
    base = {"model": "c", "messages": [{"role": "user", "content": "hi"}]}
    assert chat_params({**base, "max_tokens": 5}).sampling.max_tokens == 5
    assert chat_params({**base, "logprobs": True}).sampling.logprobs == 0
    assert not chat_params({**base, "logprobs": False}).sampling.HasField("logprobs")
    named = chat_params({**base, "tools": [{"type": "function", "function": {"name": "f"}}],
                         "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.tool_choice == ipb.ToolChoice(function="f")
    blobs: list[bytes] = []
    params = chat_params({**base, "messages": [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": b64(B)}]}]}, blobs)
    assert blobs == [B] and params.messages[0].parts[0].prompt_embeds == encoded(placeholder(0))


def test_a_refused_body_is_the_models_400() -> None:
    with pytest.raises(ApiError) as e:
        completion_params({"model": "m", "prompt": "x", "top_p": 2})
    assert (e.value.status, e.value.param, e.value.message) == (400, "top_p", "top_p: must be a number in (0, 1]")
    with pytest.raises(ApiError) as e:
        chat_params({"model": "c", "messages": []})
    assert (e.value.status, e.value.param) == (400, "messages")


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_translate_refuses_python_ints_past_float_range(field: str) -> None:
    # orjson turns such numbers into floats; a caller handing translate Python ints must still get a 400.
    with pytest.raises(ApiError) as info:
        completion_params({"model": "m", "prompt": "hi", field: 10**400})
    assert info.value.status == 400 and info.value.param == field
    with pytest.raises(ApiError) as info:
        chat_params({"model": "m", "messages": [{"role": "user", "content": "hi"}], field: -(10**400)})
    assert info.value.status == 400 and info.value.param == field


def test_finish_reasons_usage_and_fields() -> None:
    assert FINISH == {cpb.FINISH_REASON_UNSPECIFIED: None, cpb.FINISH_REASON_LENGTH: "length",
                      cpb.FINISH_REASON_STOP: "stop", cpb.FINISH_REASON_ABORT: "abort"}
    assert usage_json(cpb.Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)) == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert {"prompt", "prompt_embeds", "echo", "suffix"} <= COMPLETION_FIELDS and "messages" not in COMPLETION_FIELDS
    assert {"messages", "tools", "max_completion_tokens"} <= CHAT_FIELDS and "prompt" not in CHAT_FIELDS


@pytest.mark.parametrize("body", [[1], "x", None, 3])
def test_require_object(body: Any) -> None:
    with pytest.raises(ApiError) as e:
        require_object(body)
    assert (e.value.status, e.value.message, e.value.code) == (400, "the request body must be a JSON object",
                                                               "invalid_json")
    assert require_object({"a": 1}) == {"a": 1}


def test_an_image_url_part_goes_to_the_preprocessor_as_its_url_in_place() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    params = chat_params({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]})
    parts = params.messages[0].parts
    assert [p.WhichOneof("kind") for p in parts] == ["text", "image"]
    assert parts[1].image.url == url

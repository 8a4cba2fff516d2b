"""The Responses body model: what only the Responses API has is checked here (each refusal names its field), the
sampling fields pass through untouched for the chat path to check."""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import parse
from embedmesh.gateway.requests.responses import ResponsesRequest


def ok(**body: Any) -> ResponsesRequest:
    return parse(ResponsesRequest, {"model": "m", **body})


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(ResponsesRequest, {"model": "m", **body})
    assert e.value.status == 400
    return e.value


def test_string_input_is_one_user_message() -> None:
    assert ok(input="hi").input == [{"type": "message", "role": "user", "content": "hi"}]


def test_items_are_normalized() -> None:
    r = ok(input=[{"role": "system", "content": [{"type": "input_text", "text": "a", "extra": 1}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                  {"role": "user", "content": [{"type": "input_prompt_embeds", "data": "QUJD"},
                                               {"type": "input_prompt_embeds", "id": "emb-1"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
                  {"type": "function_call_output", "call_id": "c1", "output": "done"}])
    assert r.input == [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_prompt_embeds", "data": "QUJD"},
                                                        {"type": "input_prompt_embeds", "id": "emb-1"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]


def test_text_tools_and_tool_choice_become_the_chat_forms() -> None:
    r = ok(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"},
                                       "strict": True}},
           tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
           tool_choice={"type": "function", "name": "f"})
    assert r.text == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                             "strict": True}}
    assert r.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                         "strict": True}}]
    assert r.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert ok(input="x", text={"format": {"type": "json_object"}}).text == {"type": "json_object"}
    assert ok(input="x", text={"format": {"type": "text"}}).text is None
    assert ok(input="x", tool_choice="auto").tool_choice == "auto"


def test_sampling_fields_pass_through_unchecked() -> None:
    r = ok(input="x", temperature="hot", max_output_tokens=-3)  # the chat path refuses them, by their names
    assert r.temperature == "hot" and r.max_output_tokens == -3


@pytest.mark.parametrize(("body", "param", "code"), [
    ({}, "input", "missing"),
    ({"input": None}, "input", "invalid_type"),
    ({"input": {"role": "user"}}, "input", "invalid_type"),
    ({"input": [3]}, "input[0]", "invalid_type"),
    ({"input": [{"content": "x"}]}, "input[0].type", "missing"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user"}]}, "input[0].content", "missing"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}, "input[0].content[0].type",
     "unsupported_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0].type",
     "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url",
     "missing"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": 3}]}]},
     "input[0].content[0].image_url", "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text",
     "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_prompt_embeds", "id": ""}]}]},
     "input[0].content[0].id", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name", "missing"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments",
     "invalid_type"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", "missing"),
    ({"input": "x", "instructions": ["a"]}, "instructions", "invalid_type"),
    ({"input": "x", "store": "yes"}, "store", "invalid_type"),
    ({"input": "x", "background": True, "stream": True}, "background", "unsupported_parameter"),
    ({"input": "x", "text": "json"}, "text", "invalid_type"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema", "missing"),
    ({"input": "x", "tools": {"type": "function"}}, "tools", "invalid_type"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
    ({"input": "x", "truncation": "sometimes"}, "truncation", "invalid_value"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata", "invalid_type"),
    ({"input": "x", "made_up": 1}, "made_up", "unknown_parameter"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str, code: str) -> None:
    err = refused(body)
    assert (err.param, err.code) == (param, code), err.message
    assert err.message.startswith(param)

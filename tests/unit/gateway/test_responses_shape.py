"""A Responses request as the chat body it means, and the chat path's own refusals (``translate.chat_params``, or
the preprocessor's field names) renamed to the Responses body's fields."""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import parse
from embedmesh.gateway.requests.responses import ResponsesRequest
from embedmesh.gateway.responses_shape import renamed, to_chat
from embedmesh.gateway.translate import chat_params

HISTORY = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]


def chat_of(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], Any]:
    r = parse(ResponsesRequest, {"model": "m", **body})
    chat, _, origins = to_chat(r, body["input"], history or [])
    return chat, origins


def test_the_chat_body() -> None:
    chat, _ = chat_of({"instructions": "sys", "max_output_tokens": 7, "temperature": 0.5, "seed": 3,
                       "text": {"format": {"type": "json_object"}},
                       "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
                       "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"},
                                                              {"type": "input_prompt_embeds", "id": "emb-1"}]},
                                 {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                 {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "c1", "output": "r1"}]}, HISTORY)
    assert chat == {
        "model": "m", "temperature": 0.5, "seed": 3, "max_completion_tokens": 7,
        "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required",
        "messages": [{"role": "system", "content": "sys"}, *HISTORY,
                     {"role": "user", "content": [{"type": "text", "text": "q"},
                                                  {"type": "prompt_embeds", "id": "emb-1"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                         {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "r1"}]}
    params = chat_params(chat)  # the chat path takes it as it is
    assert [m.role for m in params.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "input_prompt_embeds", "data": "@@"}]}]},
     "input[1].content[0].data"),
])
def test_chat_refusals_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    chat, origins = chat_of({"instructions": "sys", **body}, HISTORY)
    with pytest.raises(ApiError) as e:
        chat_params(chat)
    err = renamed(e.value, origins)
    assert err.param == param and err.status == 400
    assert err.message.startswith(param)


def test_preprocessor_fields_are_renamed_too() -> None:
    _, origins = chat_of({"instructions": "sys", "input": [
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"}]}, HISTORY)
    cases = {"messages[0].content": "instructions", "messages[1]": "previous_response_id",
             "messages[3].content[0]": "input[0].content[0]", "messages[4].tool_calls[1].function.name":
             "input[2].name", "messages[4].tool_calls[0].id": "input[1].call_id",
             "messages[5].content": "input[3].output", "messages[5].tool_call_id": "input[3].call_id",
             "model": "model", "messages[99]": "messages[99]"}
    for chat_param, want in cases.items():
        err = renamed(ApiError(400, f"{chat_param}: bad", param=chat_param, code="c"), origins)
        assert (err.param, err.message, err.code) == (want, f"{want}: bad", "c")
    _, origins = chat_of({"input": "plain"})
    assert renamed(ApiError(400, "too long", param="messages[0]"), origins).param == "input"

"""Tools for chat: checking what a (gRPC or REST) client offers, the constraint for required/named calls, the hermes
parser, and the prompt the default model's template renders with tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.inference.v1 import inference_pb2
from embedmesh.services.preprocessor.chat import ChatMessage, ChatPart, ChatTemplate, build_chat_prompt
from embedmesh.services.preprocessor.prompts import Tokenizer
from embedmesh.services.preprocessor.tools import ToolParser, call_text, tools_from_proto

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def params(choice: dict[str, str] | None = None, *names: str) -> inference_pb2.ChatParams:
    p = inference_pb2.ChatParams(model="m")
    for n in names or ("get_weather",):
        p.tools.append(inference_pb2.Tool(name=n, description=f"{n} tool", parameters_json=json.dumps(WEATHER)))
    if choice:
        p.tool_choice.CopyFrom(inference_pb2.ToolChoice(**choice))
    return p


def test_auto_none_required_and_named() -> None:
    assert tools_from_proto(params()).mode == "auto"
    assert tools_from_proto(params({"mode": "none"})) is None
    assert tools_from_proto(inference_pb2.ChatParams(model="m")) is None
    spec = tools_from_proto(params({"function": "b"}, "a", "b"))
    assert spec is not None and spec.mode == "function" and spec.function == "b"


@pytest.mark.parametrize(("p", "field"), [
    (params({"function": "nope"}), "tool_choice"),
    (params(None, "bad name!"), "tools[0].function.name"),
    (params(None, "a", "a"), "tools[1].function.name"),
    (params({"mode": "sometimes"}), "tool_choice"),
])
def test_bad_tools_name_the_field(p: inference_pb2.ChatParams, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        tools_from_proto(p)
    assert e.value.field == field


def test_required_constrains_to_one_of_the_calls() -> None:
    spec = tools_from_proto(params({"mode": "required"}, "a", "b"))
    assert spec is not None
    constraint = spec.constraint()
    assert constraint is not None and constraint.kind == "json_schema"
    schema = json.loads(str(constraint.value))
    jsonschema.validate({"name": "b", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "c", "arguments": {"city": "Oslo"}}, schema)
    assert tools_from_proto(params()).constraint() is None  # auto: free text


def test_parser_reads_hermes_blocks_and_keeps_other_text() -> None:
    spec = tools_from_proto(params())
    assert spec is not None
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    rest, calls = ToolParser(spec).parse(text)
    assert rest == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 5 + 24
    # Unknown function, broken JSON: text, not calls.
    for bad in ('<tool_call>{"name": "other", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>"):
        assert ToolParser(spec).parse(bad) == (bad, [])
    # A block the model did not close before it stopped still counts.
    _, calls = ToolParser(spec).parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert len(calls) == 1


def test_constrained_output_is_read_as_one_call() -> None:
    spec = tools_from_proto(params({"mode": "required"}))
    assert spec is not None
    rest, calls = ToolParser(spec).parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert rest == "" and calls[0].name == "get_weather"


def test_the_default_template_shows_tools_in_the_system_message() -> None:
    from embedmesh.models import ensure_default_model

    folder = ensure_default_model()
    template, tok = ChatTemplate(folder), Tokenizer(folder)
    spec = tools_from_proto(params())
    messages = [ChatMessage("user", (ChatPart(text="Weather in Paris?"),)),
                ChatMessage("assistant", (ChatPart(text=call_text("get_weather", '{"city": "Paris"}')),))]
    prompt = build_chat_prompt(messages, template=template, tokenizer=tok, spec=ModelSpec(576, 8192, 1),
                               max_tokens=4, tools=spec)
    text = tok.decode([t for piece in prompt.pieces for t in piece])
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # our system message replaced the default

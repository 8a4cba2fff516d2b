"""The chat body: tools and tool choice resolved, content parts read by their type."""

from __future__ import annotations

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import ChatRequest, TextPart, parse

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_tool_choice_names_one_of_the_tools() -> None:
    req = parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                              "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert req.tool_choice == ("function", "f") and req.tools[0].function.parameters == '{"type":"object"}'
    assert isinstance(req.messages[0].content[0], TextPart)


def test_a_tool_name_given_twice_is_refused_by_its_place() -> None:
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL]})
    assert e.value.param == "tools[1].function.name"

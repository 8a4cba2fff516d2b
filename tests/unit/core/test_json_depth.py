"""JSON from clients that the mesh walks recursively is held to MAX_JSON_DEPTH levels before anything recurses."""

from __future__ import annotations

import pytest

from embedmesh.core import json_depth
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import Structured
from embedmesh.core.structured import check_structured
from embedmesh.services.preprocessor.tools import ToolRequest, check_tools


def _nested(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


def test_depth_counts_objects_and_arrays_and_stops_past_the_limit() -> None:
    assert json_depth.json_depth(1) == 0
    assert json_depth.json_depth({"a": [1, {"b": []}]}) == 4
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit: counted without recursing
        deep = [deep]
    assert json_depth.json_depth(deep, limit=10) == 11


def test_loads_takes_64_levels_and_refuses_65() -> None:
    # _nested(n) is n + 1 levels of objects (the innermost {} counts)
    assert json_depth.json_depth(json_depth.loads(_nested(63))) == 64
    with pytest.raises(ValueError, match="64 levels"):
        json_depth.loads(_nested(64))
    with pytest.raises(ValueError):
        json_depth.loads("[" * 5000 + "]" * 5000)  # orjson's own bound, no RecursionError


def test_a_deep_schema_is_refused_by_name_not_a_recursion_error() -> None:
    with pytest.raises(InvalidArgument) as info:
        check_structured(Structured("json_schema", _nested(3000)), "sampling.structured")
    assert info.value.field.startswith("sampling.structured")
    with pytest.raises(InvalidArgument) as info:
        check_structured(Structured("json_schema", _nested(200)), "sampling.structured")
    assert "64 levels" in str(info.value)


def test_deep_tool_parameters_are_refused_by_name() -> None:
    request = ToolRequest(tools=(("f", "", _nested(200)),))
    with pytest.raises(InvalidArgument) as info:
        check_tools(request)
    assert info.value.field == "tools[0].function.parameters"
    assert info.value.reason == "INVALID_SCHEMA"

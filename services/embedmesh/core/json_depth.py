"""How deep a client's JSON may nest where the mesh reads it as a structure (JSON schemas, tool arguments).

JSON schema checkers (``jsonschema``, ``xgrammar``), ``json.loads``/``json.dumps`` and the renderers recurse once or
more per level: a schema nested a few hundred deep exhausts Python's recursion limit (a ``RecursionError``, which
would be a 500 / INTERNAL). So every JSON structure from outside that is walked recursively is held to
``MAX_JSON_DEPTH`` levels first, iteratively, and parsed by ``orjson`` (which stops at 1,024 levels with a
``JSONDecodeError`` of its own instead of recursing in Python).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["MAX_JSON_DEPTH", "json_depth", "too_deep", "loads"]

MAX_JSON_DEPTH = 64
"""Most levels of objects and arrays in a JSON schema or a tool call's arguments (real schemas use under 20)."""


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Levels of dicts and lists in ``value`` (a scalar is 0), counted without recursion; stops counting once past
    ``limit`` (then returns ``limit + 1``), so a hostile value costs at most its own size to look at."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        depth += 1
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((c, depth) for c in children)
    return deepest


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    return json_depth(value, limit) > limit


def loads(text: str | bytes) -> Any:
    """``orjson.loads``, refusing (``ValueError``) more than ``MAX_JSON_DEPTH`` levels as it refuses bad JSON."""
    value = orjson.loads(text)
    if too_deep(value):
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    return value

"""Attribute filters of a search: validation, evaluation in Python, and compilation to SQL over jsonb.

    Filter = Comparison(key, op, value) | Compound(op, filters)

Semantics (the same in every backend; tests check Python against SQL against a brute-force reference):
- A comparison on a missing attribute is false, whatever the operator (as SQL NULL would be).
- ``eq`` / ``in``: same type and value (``true`` never equals ``1``). ``ne`` / ``nin``: present and not equal.
- ``gt gte lt lte``: both sides numbers, or both strings (compared by code point); any other pairing is false.
- ``and`` / ``or`` over one or more sub-filters, nested up to ``MAX_DEPTH`` levels (TOO_DEEP) with at most
  ``MAX_NODES`` filters in all (TOO_MANY_CLAUSES). Both are checked by walks with an explicit stack, so no nesting
  depth can exhaust Python's recursion limit; ``check_json_limits`` applies them to the raw JSON, before the gateway
  builds a nested protobuf message (protobuf itself refuses nesting past 100 levels).
Validation names the offending field with its path (``filters.filters[1].value``) so the gateway can fill ``param``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.objects import Attributes, AttributeValue

__all__ = ["Comparison", "Compound", "Filter", "validate", "evaluate", "to_sql", "COMPARISON_OPS", "COMPOUND_OPS",
           "MAX_DEPTH", "MAX_NODES", "check_attributes", "check_json_limits"]

COMPARISON_OPS = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin")
COMPOUND_OPS = ("and", "or")
MAX_DEPTH = 8
MAX_NODES = 256
MAX_LIST = 1024
MAX_ATTRIBUTES = 16
MAX_KEY_CHARS = 64
MAX_STRING_CHARS = 512


@dataclass(frozen=True)
class Comparison:
    key: str
    op: str
    value: AttributeValue | tuple[AttributeValue, ...] | None


@dataclass(frozen=True)
class Compound:
    op: str
    filters: tuple[Filter, ...]


Filter = Comparison | Compound


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    return type(v).__name__


def _bad(field: str, message: str, reason: str = "INVALID_FILTER") -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", field=field, reason=reason)


def _check_size(nodes: int, depth: int, field: str, path: str) -> None:
    if nodes > MAX_NODES:
        raise _bad(field, f"more than {MAX_NODES} filters in all (comparisons and compounds)", "TOO_MANY_CLAUSES")
    if depth > MAX_DEPTH:
        raise _bad(path, f"filters nest at most {MAX_DEPTH} levels deep", "TOO_DEEP")


def check_json_limits(value: Any, field: str = "filters") -> None:
    """Depth and size limits on a filter still in its JSON form (``{"type": "and", "filters": [...]}``), walked
    with an explicit stack: the gateway calls it before recursing over the JSON or nesting protobuf messages.
    Everything else about the filter is checked later, by ``validate`` in the service."""
    stack: list[tuple[Any, str, int]] = [(value, field, 1)]
    nodes = 0
    while stack:
        node, path, depth = stack.pop()
        nodes += 1
        _check_size(nodes, depth, field, path)
        subs = node.get("filters") if isinstance(node, dict) and node.get("type") in COMPOUND_OPS else None
        if isinstance(subs, list):
            _check_size(nodes + len(subs), depth, field, path)  # before a million siblings go on the stack
            # reversed: pop in document order, so the first offending path reported is the first one written
            stack.extend((s, f"{path}.filters[{i}]", depth + 1) for i, s in reversed(list(enumerate(subs))))


def validate(f: Filter, field: str = "filters") -> Filter:
    """Raise InvalidArgument naming the first bad field; return ``f`` unchanged when it is valid."""
    stack: list[tuple[Filter, str, int]] = [(f, field, 1)]
    nodes = 0
    while stack:  # pre-order, document order; an explicit stack so depth cannot blow Python's recursion limit
        node, path, depth = stack.pop()
        nodes += 1
        _check_size(nodes, depth, field, path)
        if isinstance(node, Compound):
            if node.op not in COMPOUND_OPS:
                raise _bad(f"{path}.type", f"compound type must be one of {', '.join(COMPOUND_OPS)}, "
                                           f"got {node.op!r}")
            if not node.filters:
                raise _bad(f"{path}.filters", "a compound filter needs at least one sub-filter")
            _check_size(nodes + len(node.filters), depth, field, path)
            stack.extend((sub, f"{path}.filters[{i}]", depth + 1) for i, sub in reversed(list(enumerate(node.filters))))
            continue
        _check_comparison(node, path)
    return f


def _check_comparison(node: Comparison, path: str) -> None:
    if not isinstance(node.key, str) or not node.key:
        raise _bad(f"{path}.key", "must be a non-empty attribute name")
    if node.op not in COMPARISON_OPS:
        raise _bad(f"{path}.type", f"comparison type must be one of {', '.join(COMPARISON_OPS)}, got {node.op!r}")
    v = node.value
    if node.op in ("in", "nin"):
        if not isinstance(v, tuple | list):
            raise _bad(f"{path}.value", f"'{node.op}' needs a list of strings or numbers, got {_kind(v)}")
        if not v or len(v) > MAX_LIST:
            raise _bad(f"{path}.value", f"'{node.op}' needs 1 to {MAX_LIST} values, got {len(v)}")
        for j, item in enumerate(v):
            if _kind(item) not in ("string", "number"):
                raise _bad(f"{path}.value[{j}]", f"must be a string or a number, got {_kind(item)}")
            _check_number(item, f"{path}.value[{j}]")
        return
    if v is None or isinstance(v, tuple | list):
        raise _bad(f"{path}.value", f"'{node.op}' needs a string, number or boolean, got "
                                    f"{'a list' if v is not None else 'nothing'}")
    kind = _kind(v)
    if kind not in ("string", "number", "boolean"):
        raise _bad(f"{path}.value", f"must be a string, number or boolean, got {kind}")
    if node.op in ("gt", "gte", "lt", "lte") and kind == "boolean":
        raise _bad(f"{path}.value", f"'{node.op}' compares numbers or strings, not booleans")
    _check_number(v, f"{path}.value")


def _check_number(v: Any, path: str) -> None:
    if _kind(v) == "number" and not math.isfinite(float(v)):
        raise _bad(path, "numbers must be finite")


def check_attributes(attrs: Attributes, field: str = "attributes") -> Attributes:
    """OpenAI's limits: at most 16 keys of up to 64 characters; strings up to 512 characters; finite numbers."""
    if len(attrs) > MAX_ATTRIBUTES:
        raise InvalidArgument(f"{field}: at most {MAX_ATTRIBUTES} attributes, got {len(attrs)}", field=field,
                              reason="TOO_MANY_ATTRIBUTES")
    for k, v in attrs.items():
        if not k or len(k) > MAX_KEY_CHARS:
            raise InvalidArgument(f"{field}: keys must have 1 to {MAX_KEY_CHARS} characters, got {k!r}",
                                  field=f"{field}.{k}", reason="INVALID_ATTRIBUTE")
        kind = _kind(v)
        if kind not in ("string", "number", "boolean"):
            raise InvalidArgument(f"{field}.{k}: must be a string, number or boolean, got {kind}",
                                  field=f"{field}.{k}", reason="INVALID_ATTRIBUTE")
        if kind == "string" and len(str(v)) > MAX_STRING_CHARS:
            raise InvalidArgument(f"{field}.{k}: strings have at most {MAX_STRING_CHARS} characters",
                                  field=f"{field}.{k}", reason="INVALID_ATTRIBUTE")
        if kind == "number" and not math.isfinite(float(v)):  # type: ignore[arg-type]
            raise InvalidArgument(f"{field}.{k}: numbers must be finite", field=f"{field}.{k}",
                                  reason="INVALID_ATTRIBUTE")
    return attrs


def _equal(a: Any, b: Any) -> bool:
    ka = _kind(a)
    return ka == _kind(b) and (float(a) == float(b) if ka == "number" else a == b)


def evaluate(f: Filter, attrs: Attributes) -> bool:
    """Whether a file with ``attrs`` passes a validated filter."""
    if isinstance(f, Compound):
        if f.op == "and":
            return all(evaluate(s, attrs) for s in f.filters)
        return any(evaluate(s, attrs) for s in f.filters)
    if f.key not in attrs:
        return False
    a, v, op = attrs[f.key], f.value, f.op
    if op == "eq":
        return _equal(a, v)
    if op == "ne":
        return not _equal(a, v)
    if op == "in":
        return any(_equal(a, x) for x in v)  # type: ignore[union-attr]
    if op == "nin":
        return not any(_equal(a, x) for x in v)  # type: ignore[union-attr]
    ka = _kind(a)
    if ka != _kind(v) or ka == "boolean":
        return False
    x, y = (float(a), float(v)) if ka == "number" else (a, v)  # type: ignore[arg-type]
    return {"gt": x > y, "gte": x >= y, "lt": x < y, "lte": x <= y}[op]  # type: ignore[operator]


def _jsonb(v: Any) -> str:
    return json.dumps(float(v) if _kind(v) == "number" else v)


_SQL_OPS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}


def to_sql(f: Filter, column: str = "attributes") -> tuple[str, list[Any]]:
    """A PostgreSQL boolean expression over a jsonb ``column`` with %s placeholders, same semantics as
    ``evaluate``. Ordering comparisons sit in CASE so the cast never runs on a value of the wrong type."""
    if isinstance(f, Compound):
        parts, params = [], []
        for s in f.filters:
            sql, p = to_sql(s, column)
            parts.append(f"({sql})")
            params.extend(p)
        return (" AND " if f.op == "and" else " OR ").join(parts), params
    ref = f"({column} -> %s)"
    op, v = f.op, f.value
    if op == "eq":
        return f"{ref} = %s::jsonb", [f.key, _jsonb(v)]
    if op == "ne":
        return f"{ref} <> %s::jsonb", [f.key, _jsonb(v)]
    if op in ("in", "nin"):
        values = list(v)  # type: ignore[arg-type]
        arr = "ARRAY[" + ", ".join(["%s::jsonb"] * len(values)) + "]"
        expr = f"{ref} = ANY({arr})"
        params: list[Any] = [f.key, *(_jsonb(x) for x in values)]
        if op == "in":
            return expr, params
        # NOT(NULL) stays NULL (false) for a missing key; present and in none of them -> true.
        return f"NOT ({expr})", params
    kind = _kind(v)
    if kind == "number":
        return (f"CASE WHEN jsonb_typeof({ref}) = 'number' THEN ({column} ->> %s)::float8 {_SQL_OPS[op]} %s "
                f"ELSE false END"), [f.key, f.key, float(v)]  # type: ignore[arg-type]
    return (f"CASE WHEN jsonb_typeof({ref}) = 'string' THEN ({column} ->> %s) COLLATE \"C\" {_SQL_OPS[op]} "
            f"%s COLLATE \"C\" ELSE false END"), [f.key, f.key, v]

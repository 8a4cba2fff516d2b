"""Filters: a validation table; evaluation against an independent brute-force reference on random attributes and
random nested filters; and the SQL compilation (pgvector pushdown) against the same reference on a real
PostgreSQL."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.filters import (
    MAX_DEPTH,
    MAX_NODES,
    Comparison,
    Compound,
    Filter,
    check_json_limits,
    evaluate,
    to_sql,
    validate,
)

C, K = Comparison, Compound


def nest(levels: int, leaf: Filter) -> Filter:
    for _ in range(levels):
        leaf = K("and", (leaf,))
    return leaf


@pytest.mark.parametrize(("flt", "field"), [
    (C("", "eq", "x"), "filters.key"),
    (C("a", "like", "x"), "filters.type"),
    (C("a", "eq", None), "filters.value"),
    (C("a", "eq", ("x",)), "filters.value"),
    (C("a", "gt", True), "filters.value"),
    (C("a", "lt", float("nan")), "filters.value"),
    (C("a", "in", "x"), "filters.value"),
    (C("a", "in", ()), "filters.value"),
    (C("a", "nin", ("x", True)), "filters.value[1]"),
    (K("xor", (C("a", "eq", 1),)), "filters.type"),
    (K("and", ()), "filters.filters"),
    (K("and", (C("a", "eq", 1), K("or", (C("b", "gte", True),)))), "filters.filters[1].filters[0].value"),
    (nest(8, C("a", "eq", 1)), "filters" + ".filters[0]" * 8),
])
def test_validation_table(flt: Filter, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validate(flt)
    assert e.value.field == field
    assert field in e.value.message


def test_depth_and_size_limits_have_their_own_reasons() -> None:
    with pytest.raises(InvalidArgument) as e:
        validate(nest(149, C("a", "eq", 1)))  # 150 levels, as a hostile client sent
    assert e.value.reason == "TOO_DEEP" and e.value.field == "filters" + ".filters[0]" * MAX_DEPTH
    assert f"at most {MAX_DEPTH} levels" in e.value.message
    validate(nest(MAX_DEPTH - 1, C("a", "eq", 1)))  # exactly MAX_DEPTH levels passes
    wide = K("or", tuple(C("a", "eq", i) for i in range(MAX_NODES)))  # MAX_NODES + 1 filters with the compound
    with pytest.raises(InvalidArgument) as e:
        validate(wide)
    assert e.value.reason == "TOO_MANY_CLAUSES" and e.value.field == "filters"
    validate(K("or", tuple(C("a", "eq", i) for i in range(MAX_NODES - 1))))


def test_validation_reports_the_first_bad_filter_in_document_order() -> None:
    flt = K("and", (K("or", (C("a", "eq", 1), C("", "eq", 1))), C("b", "like", 1)))
    with pytest.raises(InvalidArgument) as e:
        validate(flt)
    assert e.value.field == "filters.filters[0].filters[1].key"


def _json_nest(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "eq", "key": "a", "value": 1}
    for _ in range(levels):
        node = {"type": "and", "filters": [node]}
    return node


@pytest.mark.parametrize("levels", [150, 5000, 200_000])
def test_json_limits_refuse_deep_nesting_without_recursion(levels: int) -> None:
    # 200 000 levels would overflow any recursive walk (Python's limit is about 1000 frames).
    with pytest.raises(InvalidArgument) as e:
        check_json_limits(_json_nest(levels))
    assert e.value.reason == "TOO_DEEP"
    assert e.value.field == "filters" + ".filters[0]" * MAX_DEPTH


def test_json_limits_accept_what_validate_accepts_and_refuse_wide_filters() -> None:
    check_json_limits(_json_nest(MAX_DEPTH - 1))
    check_json_limits({"type": "eq", "key": "a", "value": [1] * 5000})  # values are not filters
    check_json_limits({"type": "xor", "filters": "not even a list"})  # shape errors are the translation's
    with pytest.raises(InvalidArgument) as e:
        check_json_limits({"type": "or", "filters": [{"type": "eq", "key": "a", "value": 1}] * 1_000_000})
    assert e.value.reason == "TOO_MANY_CLAUSES" and e.value.field == "filters"


@pytest.mark.parametrize("flt", [
    C("a", "eq", "x"), C("a", "ne", 1.5), C("a", "eq", False), C("a", "gte", "2024-01-01"), C("a", "in", ("x", 2)),
    K("or", (C("a", "eq", 1), K("and", (C("b", "lt", 3), C("c", "nin", ("z",)))))),
])
def test_validation_accepts(flt: Filter) -> None:
    assert validate(flt) is flt


# --- an independent reference: written from the rules in the filters module's docstring --------------------------
def reference(f: Filter, attrs: dict[str, Any]) -> bool:
    if isinstance(f, Compound):
        results = [reference(s, attrs) for s in f.filters]
        return all(results) if f.op == "and" else any(results)
    if f.key not in attrs:
        return False
    a = attrs[f.key]

    def tag(v: Any) -> tuple[str, Any]:
        if type(v) is bool:
            return ("b", v)
        if type(v) in (int, float):
            return ("n", float(v))
        return ("s", v)

    ta = tag(a)
    if f.op in ("in", "nin"):
        hit = ta in [tag(v) for v in f.value]  # type: ignore[union-attr]
        return hit if f.op == "in" else not hit
    tv = tag(f.value)
    if f.op == "eq":
        return ta == tv
    if f.op == "ne":
        return ta != tv
    if ta[0] != tv[0] or ta[0] == "b":
        return False
    return {"gt": ta[1] > tv[1], "gte": ta[1] >= tv[1], "lt": ta[1] < tv[1], "lte": ta[1] <= tv[1]}[f.op]


VALUES: list[Any] = ["a", "b", "ab", "B", "é", 0, 1, 2.5, -1, True, False]


def random_attrs(rng: random.Random) -> dict[str, Any]:
    return {k: rng.choice(VALUES) for k in ("x", "y", "z") if rng.random() < 0.8}


def random_filter(rng: random.Random, depth: int = 0) -> Filter:
    if depth < 3 and rng.random() < 0.35:
        return Compound(rng.choice(["and", "or"]), tuple(random_filter(rng, depth + 1)
                                                         for _ in range(rng.randint(1, 3))))
    op = rng.choice(["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin"])
    key = rng.choice(["x", "y", "z", "w"])
    if op in ("in", "nin"):
        return Comparison(key, op, tuple(rng.choice([v for v in VALUES if type(v) is not bool])
                                         for _ in range(rng.randint(1, 3))))
    pool = VALUES if op in ("eq", "ne") else [v for v in VALUES if type(v) is not bool]
    return Comparison(key, op, rng.choice(pool))


CASES = 400


def _cases() -> list[tuple[Filter, list[dict[str, Any]]]]:
    rng = random.Random(1234)
    docs = [random_attrs(rng) for _ in range(60)]
    return [(validate(random_filter(rng)), docs) for _ in range(CASES)]


def test_evaluate_matches_reference() -> None:
    disagreements = 0
    for flt, docs in _cases():
        for d in docs:
            disagreements += evaluate(flt, d) != reference(flt, d)
    assert disagreements == 0


def test_sql_matches_reference(pg: Any) -> None:
    import psycopg

    cases = _cases()
    docs = cases[0][1]
    with psycopg.connect(pg.database(), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int, attributes jsonb)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO t VALUES (%s, %s::jsonb)", [(i, json.dumps(d)) for i, d in enumerate(docs)])
        for flt, _ in cases:
            sql, params = to_sql(flt)
            got = {r[0] for r in conn.execute(f"SELECT id FROM t WHERE {sql}", params).fetchall()}
            want = {i for i, d in enumerate(docs) if reference(flt, d)}
            assert got == want, flt

"""Costs computed by hand (the cost function alone, then whole decisions), tie breaking, softmax temperature,
and the bad-input table of a decision."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.registry import Registry, WorkerState
from embedmesh.services.router.scoring import Weights, choose, score


@pytest.mark.parametrize(
    "blocks,overlaps,loads,weights,expected",
    [
        (10, {"a": 10}, {"a": 0, "b": 0}, Weights(), {"a": 0.0, "b": 10.0}),
        (10, {"a": 10}, {"a": 12, "b": 0}, Weights(), {"a": 12.0, "b": 10.0}),
        (10, {"a": 4, "b": 8}, {"a": 1, "b": 3}, Weights(prefill=2, decode=0.5), {"a": 12.5, "b": 5.5}),
        (0, {}, {"a": 2, "b": 1}, Weights(), {"a": 2.0, "b": 1.0}),
    ],
)
def test_costs(blocks: int, overlaps: dict[str, int], loads: dict[str, int], weights: Weights,
               expected: dict[str, float]) -> None:
    scored = score(blocks, overlaps, loads, weights)
    assert {s.worker_id: s.cost for s in scored} == expected
    assert scored[0].cost == min(expected.values())


def test_ties_are_broken_at_random() -> None:
    scored = score(4, {}, {"a": 0, "b": 0, "c": 0}, Weights())
    picks = Counter(choose(scored, Weights(), random.Random(i)).worker_id for i in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 50


def test_zero_temperature_always_cheapest_and_temperature_spreads() -> None:
    scored = score(10, {"a": 10}, {"a": 0, "b": 0}, Weights())
    assert {choose(scored, Weights(), random.Random(i)).worker_id for i in range(50)} == {"a"}
    hot = Weights(temperature=10.0)
    picks = Counter(choose(score(10, {"a": 10}, {"a": 0, "b": 0}, hot), hot, random.Random(i)).worker_id
                    for i in range(500))
    assert picks["b"] > 50 and picks["a"] > picks["b"]


# --- one decision through KvRouter: the registry's loads and the index's overlaps, hand-computed -------------------



def router(weights: Weights = Weights()) -> KvRouter:  # noqa: B008 - frozen dataclass
    reg = Registry()
    for wid, active in (("a", 0), ("b", 2), ("c", 5)):
        reg.register(WorkerState(wid, f"{wid}:1", "m", 4, "test", True)).active_requests = active
    reg.index.stored("a", 0, [1, 2])
    reg.index.stored("b", 0, [1, 2, 3, 4])
    reg.index.stored("c", 0, [1, 2, 3, 4, 5])
    return KvRouter(reg, weights, random.Random(0))


@pytest.mark.parametrize(
    "weights,prompt_tokens,expected,winner",
    [
        # 5 hashes, 22 positions -> 6 blocks (the partial tail counts as prefill for everyone)
        (Weights(), 22, {"a": 4 + 0, "b": 2 + 2, "c": 1 + 5}, None),  # a and b tie at 4
        (Weights(prefill=1, decode=0), 22, {"a": 4, "b": 2, "c": 1}, "c"),
        (Weights(prefill=0, decode=1), 22, {"a": 0, "b": 2, "c": 5}, "a"),
        (Weights(prefill=2, decode=0.5), 20, {"a": 6.0, "b": 3.0, "c": 2.5}, "c"),
    ],
)
def test_decision_costs(weights: Weights, prompt_tokens: int, expected: dict[str, float], winner: str | None) -> None:
    d = router(weights).route("m", [1, 2, 3, 4, 5], 4, prompt_tokens)
    costs = {s.worker_id: s.cost for s, _ in d.candidates}
    assert costs == expected
    assert [s.cost for s, _ in d.candidates] == sorted(costs.values())
    if winner:
        assert d.worker_id == winner
    else:
        assert d.worker_id in {"a", "b"}
    assert d.address == f"{d.worker_id}:1"
    assert d.overlap_blocks == {"a": 2, "b": 4, "c": 5}[d.worker_id]


def test_routing_counts_against_load_until_the_next_heartbeat() -> None:
    r = router(Weights(prefill=0, decode=1))
    picks = [r.route("m", [], 4, 4).worker_id for _ in range(3)]
    assert picks[0] == "a" and r.registry.workers["a"].load == picks.count("a")
    assert r.routes == 3


@pytest.mark.parametrize(
    "args,field,exc",
    [
        (("", [1], 4, 4), "model", InvalidArgument),
        (("m", [1], 0, 4), "block_size", InvalidArgument),
        (("m", [1], 4, 0), "prompt_tokens", InvalidArgument),
        (("m", [1, 2], 4, 7), "block_hashes", InvalidArgument),
        (("m", [0], 4, 4), "block_hashes", InvalidArgument),
        (("m", [1], 8, 8), "block_size", InvalidArgument),
        (("other", [1], 4, 4), "model", Unavailable),
    ],
)
def test_bad_decisions_name_the_field(args: tuple, field: str, exc: type) -> None:
    with pytest.raises(exc) as info:
        router().route(*args)
    assert info.value.field == field

"""router.scoring: costs computed by hand (the cost function alone), tie breaking, softmax temperature."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from embedmesh.services.router.scoring import Scored, Weights, choose, choose_blind, score


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


def test_choose_blind_takes_turns_in_worker_order_or_any_one() -> None:
    scored = [Scored("b", 9, 0, 0.0), Scored("a", 0, 9, 9.0)]
    rng = random.Random(0)
    assert [choose_blind(scored, "round-robin", t, rng).worker_id for t in range(3)] == ["a", "b", "a"]
    assert {choose_blind(scored, "random", 0, rng).worker_id for _ in range(40)} == {"a", "b"}
    with pytest.raises(ValueError, match="mode must be one of kv, round-robin, random"):
        choose_blind(scored, "best", 0, rng)

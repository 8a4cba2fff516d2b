"""router.policy: one decision through KvRouter from the registry's loads and the index's overlaps (costs computed
by hand), overlap against load, adapters, the counts and metrics a decision leaves, and the bad-input table."""

from __future__ import annotations

import random

import pytest

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.services.router.metrics import DECISIONS, MATCHED_BLOCKS
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.registry import Registry, WorkerState
from embedmesh.services.router.scoring import Weights


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


def _two(load_a: int, load_b: int, weights: Weights = Weights(), events: bool = True) -> KvRouter:  # noqa: B008
    """Worker a holds the prompt's 4 blocks, b holds none; their loads are given."""
    reg = Registry()
    for wid, active in (("a", load_a), ("b", load_b)):
        reg.register(WorkerState(wid, f"{wid}:1", "m", 4, "test", events)).active_requests = active
    reg.index.stored("a", 0, [11, 12, 13, 14])
    return KvRouter(reg, weights, random.Random(0))


@pytest.mark.parametrize("load_a,winner", [(0, "a"), (3, "a"), (5, "b"), (9, "b")])
def test_overlap_wins_until_the_load_costs_more_than_the_prefill_it_saves(load_a: int, winner: str) -> None:
    # a: cost = 0 blocks to prefill + load_a; b: 4 blocks to prefill + 1 running request = 5.
    d = _two(load_a, 1).route("m", [11, 12, 13, 14], 4, 16)
    assert d.worker_id == winner
    assert d.overlap_blocks == (4 if winner == "a" else 0)
    assert {s.worker_id: s.cost for s, _ in d.candidates} == {"a": float(load_a), "b": 5.0}


def test_a_heavier_prefill_weight_keeps_requests_on_the_cached_worker() -> None:
    assert _two(9, 1).route("m", [11, 12, 13, 14], 4, 16).worker_id == "b"
    assert _two(9, 1, Weights(prefill=3)).route("m", [11, 12, 13, 14], 4, 16).worker_id == "a"


def test_only_workers_of_the_model_with_the_block_size_are_candidates() -> None:
    reg = Registry()
    reg.register(WorkerState("m8", "m8:1", "m", 8, "test", True))
    reg.register(WorkerState("m4", "m4:1", "m", 4, "test", True)).active_requests = 50
    reg.register(WorkerState("other", "o:1", "other", 4, "test", True))
    d = KvRouter(reg, Weights()).route("m", [], 4, 4)
    assert d.worker_id == "m4" and [s.worker_id for s, _ in d.candidates] == ["m4"]
    with pytest.raises(InvalidArgument) as info:
        KvRouter(reg, Weights()).route("m", [], 16, 16)
    assert info.value.reason == "BLOCK_SIZE_MISMATCH"
    assert info.value.message == "block_size: workers of 'm' use block sizes [4, 8], got 16"


def test_adapter_requests_go_to_holders_and_fall_back_to_load_with_a_flag() -> None:
    r = _two(0, 3)
    r.registry.workers["b"].adapters = frozenset({"sql"})
    d = r.route("m", [11, 12, 13, 14], 4, 16, adapter="sql")
    assert (d.worker_id, d.adapter_missing) == ("b", False)  # the only holder, despite a's cached prefix
    assert [s.worker_id for s, _ in d.candidates] == ["b"]
    d = r.route("m", [], 4, 16, adapter="nobody-has-it")
    assert d.adapter_missing and d.worker_id == "a"  # least loaded of the model's workers
    assert {s.worker_id for s, _ in d.candidates} == {"a", "b"}


def test_a_decision_counts_and_is_measured() -> None:
    r = _two(0, 0)
    hit = DECISIONS.labels("m", "yes")._value.get()
    prompt = MATCHED_BLOCKS.labels("m", "prompt")._value.get()
    cached = MATCHED_BLOCKS.labels("m", "cached")._value.get()
    d = r.route("m", [11, 12, 13, 14], 4, 16, request_id="req-1")
    assert d.worker_id == "a" and r.routes == 1
    assert r.registry.workers["a"].routed_since_load == 1 and r.registry.workers["b"].routed_since_load == 0
    assert DECISIONS.labels("m", "yes")._value.get() == hit + 1
    assert MATCHED_BLOCKS.labels("m", "prompt")._value.get() == prompt + 4
    assert MATCHED_BLOCKS.labels("m", "cached")._value.get() == cached + 4


def test_workers_without_events_are_assumed_to_cache_what_was_routed_to_them() -> None:
    r = _two(0, 0, events=False)
    r.registry.index.remove_worker("a")
    first = r.route("m", [21, 22], 4, 8)
    assert first.overlap_blocks == 0
    again = r.route("m", [21, 22], 4, 8)
    assert again.worker_id == first.worker_id and again.overlap_blocks == 2


def test_round_robin_and_random_modes_ignore_cache_and_load_but_report_the_overlap() -> None:
    r = router()
    r.mode = "round-robin"
    picks = [r.route("m", [1, 2, 3, 4, 5], 4, 22) for _ in range(6)]
    assert [d.worker_id for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert [d.overlap_blocks for d in picks[:3]] == [2, 4, 5]
    r = router()
    r.mode = "random"
    assert {r.route("m", [1, 2, 3, 4, 5], 4, 22).worker_id for _ in range(60)} == {"a", "b", "c"}

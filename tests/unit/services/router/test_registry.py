"""Registry: event ids, gaps and snapshots; liveness by silence; re-registration and stale sessions."""

from __future__ import annotations

import time

from embedmesh.services.router.registry import (
    BatchOutcome,
    Cleared,
    EventBatch,
    Registry,
    Removed,
    Stored,
    WorkerState,
)


def worker(wid: str = "a", events: bool = True) -> WorkerState:
    return WorkerState(wid, f"{wid}:1", "m", 4, "test", events)


def test_batches_in_order_apply_and_a_gap_waits_for_a_snapshot() -> None:
    reg = Registry()
    a = reg.register(worker())
    assert reg.apply(a, EventBatch(1, [Stored(0, [1, 2, 3])])) is BatchOutcome.APPLIED
    assert reg.apply(a, EventBatch(2, [Removed([3])])) is BatchOutcome.APPLIED
    assert reg.index.find_matches([1, 2, 3]) == {"a": 2}
    assert reg.apply(a, EventBatch(5, [Stored(0, [9])])) is BatchOutcome.GAP
    assert reg.apply(a, EventBatch(6, [Stored(0, [9])])) is BatchOutcome.AWAITING_SNAPSHOT
    assert reg.index.find_matches([9]) == {} and a.last_event_id == 2
    assert reg.apply(a, EventBatch(7, [Stored(0, [7, 8])], snapshot=True)) is BatchOutcome.APPLIED
    assert reg.index.find_matches([1]) == {}, "the snapshot replaces what was held"
    assert reg.index.find_matches([7, 8]) == {"a": 2}
    assert reg.apply(a, EventBatch(8, [Cleared()])) is BatchOutcome.APPLIED
    assert reg.index.blocks_of("a") == 0


def test_silent_workers_are_swept_with_their_blocks() -> None:
    reg = Registry(stale_seconds=2)
    a, b = reg.register(worker("a")), reg.register(worker("b"))
    reg.apply(a, EventBatch(1, [Stored(0, [1])]))
    reg.apply(b, EventBatch(1, [Stored(0, [1])]))
    now = time.monotonic()
    reg.heartbeat(b, 3, 0.5)
    b.last_seen = now + 2
    assert reg.sweep(now=now + 2.5) == ["a"]
    assert reg.index.find_matches([1]) == {"b": 1} and b.active_requests == 3


def test_re_registration_replaces_and_old_session_cannot_drop_the_new_one() -> None:
    reg = Registry()
    old = reg.register(worker())
    reg.apply(old, EventBatch(1, [Stored(0, [1])]))
    new = reg.register(worker())
    assert not reg.is_live(old) and reg.is_live(new)
    assert reg.index.blocks_of("a") == 0, "a new registration starts from an empty index (its snapshot refills it)"
    assert not reg.drop("a", old.session)
    assert reg.drop("a", new.session) and "a" not in reg.workers


def test_routing_counts_load_and_tracks_blocks_only_for_workers_without_events() -> None:
    reg = Registry(approx_ttl_seconds=10)
    reg.register(worker("ev", events=True))
    reg.register(worker("approx", events=False))
    reg.record_routed("ev", [1, 2], now=0)
    reg.record_routed("approx", [1, 2], now=0)
    reg.record_routed("gone", [1, 2], now=0)
    assert reg.workers["ev"].load == 1 and reg.workers["approx"].load == 1
    assert reg.index.find_matches([1, 2]) == {"approx": 2}
    reg.approx.expire(now=11)
    assert reg.index.find_matches([1, 2]) == {}

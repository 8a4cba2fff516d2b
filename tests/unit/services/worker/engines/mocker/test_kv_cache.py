"""The simulated paged KV cache: prefix reuse by chained hash, LRU eviction (tail first), the events it publishes,
snapshots and clearing."""

from __future__ import annotations

from embedmesh.core.block_hash import ROOT, hash_token_blocks
from embedmesh.core.kv_events import Cleared, KvEvent, Removed, Stored
from embedmesh.services.worker.engines.mocker.kv_cache import PagedKvCache

BS = 4


def chain(*ids: int) -> list[int]:
    return hash_token_blocks(list(ids), BS)


def cache(num_blocks: int) -> tuple[PagedKvCache, list[KvEvent]]:
    events: list[KvEvent] = []
    return PagedKvCache(num_blocks, BS, events.extend), events


def run(c: PagedKvCache, hashes: list[int], total: int) -> int:
    """Admit, prefill and finish one sequence; returns its cache hit in blocks."""
    a = c.allocate(hashes, total)
    assert a is not None
    c.commit_prefill(a)
    c.release(a)
    return a.hit


def test_a_repeated_prefix_is_reused_and_stored_once() -> None:
    c, events = cache(16)
    a = chain(*range(12))
    assert run(c, a, 4) == 0
    assert events == [Stored(ROOT, tuple(a))]
    b = chain(*range(8), 99, 98, 97, 96)  # same first two blocks
    assert run(c, b, 4) == 2
    assert events[1:] == [Stored(b[1], (b[2],))]
    assert c.cached_blocks == 4 and c.used_blocks == 0


def test_blocks_in_use_are_shared_and_never_evicted() -> None:
    c, events = cache(6)
    a = chain(*range(8))
    first = c.allocate(a, 3)
    assert first is not None
    c.commit_prefill(first)
    second = c.allocate(a, 3)  # shares 2 blocks, needs 1 more
    assert second is not None and second.hit == 2
    assert c.used_blocks == 4 and c.free_blocks == 2
    assert c.allocate(chain(*range(100, 112)), 3) is None  # would need 3 free: refused, nothing changed
    assert c.used_blocks == 4 and not any(isinstance(e, Removed) for e in events)
    c.release(first)
    c.release(second)
    assert c.used_blocks == 0 and c.cached_blocks == 2


def test_lru_evicts_least_recently_used_tail_first_and_publishes_removed() -> None:
    c, events = cache(4)
    a, b = chain(*range(8)), chain(*range(50, 58))
    run(c, a, 2)
    run(c, b, 2)
    assert run(c, a, 2) == 2  # touch a: b is now the least recently used
    events.clear()
    x = chain(*range(90, 94))
    run(c, x, 1)  # needs one block: b's tail goes first
    assert events == [Removed((b[1],)), Stored(ROOT, (x[0],))]
    assert c.cached_prefix(b) == 1 and c.cached_prefix(a) == 2


def test_an_evicted_head_breaks_the_chain_for_its_children() -> None:
    c, _ = cache(2)
    a = chain(*range(8))
    run(c, a, 2)
    run(c, chain(*range(50, 54)), 1)  # evicts a's tail (released tail first)
    assert c.cached_prefix(a) == 1


def test_generated_blocks_are_stored_when_the_sequence_finishes() -> None:
    c, events = cache(8)
    prompt = chain(*range(4))
    full = chain(*range(4), 7, 7, 7, 7)
    alloc = c.allocate(prompt, 2)
    assert alloc is not None
    c.commit_prefill(alloc)
    c.release(alloc, full)
    assert events == [Stored(ROOT, (prompt[0],)), Stored(full[0], (full[1],))]
    assert c.cached_prefix(full) == 2


def test_an_aborted_sequence_before_prefill_stores_nothing() -> None:
    c, events = cache(8)
    alloc = c.allocate(chain(*range(8)), 3)
    assert alloc is not None
    c.release(alloc)
    assert events == [] and c.free_blocks == 8


def test_snapshot_lists_parents_before_children() -> None:
    c, _ = cache(16)
    a, b = chain(*range(12)), chain(*range(4), 9, 9, 9, 9)
    run(c, a, 3)
    run(c, b, 2)
    seen = {ROOT}
    for e in c.snapshot():
        assert isinstance(e, Stored) and e.parent_hash in seen
        seen.update(e.block_hashes)
    assert seen == {ROOT, *a, *b}


def test_clear_refuses_while_blocks_are_in_use_then_publishes_cleared() -> None:
    c, events = cache(8)
    alloc = c.allocate(chain(*range(4)), 2)
    assert alloc is not None
    assert not c.clear()
    c.commit_prefill(alloc)
    c.release(alloc)
    events.clear()
    assert c.clear()
    assert events == [Cleared()] and c.cached_blocks == 0 and c.free_blocks == 8

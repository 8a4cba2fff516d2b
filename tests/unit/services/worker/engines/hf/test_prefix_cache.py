"""The hf prefix cache's bookkeeping (``prefix_cache.py``), without a model: blocks found by their chained hashes
up to the first one missing, LRU eviction under the capacity with a prefix's head outliving its tail, the KV events
each change publishes (stored runs, removed, cleared), an adapter's blocks dropped, the re-sync snapshot, and the
hashes of a request (the router's chain: text, rows, resumed tokens, adapter key)."""

from __future__ import annotations

import numpy as np
import pytest

from embedmesh.core.block_hash import adapter_block_hashes, block_hashes
from embedmesh.core.kv_events import Cleared, KvEvent, Removed, Stored
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import EmbedsSegment, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.hf.prefix_cache import PrefixCache, request_hashes


def _cache(capacity: int) -> tuple[PrefixCache, list[KvEvent]]:
    events: list[KvEvent] = []
    return PrefixCache(capacity, 4, events.extend), events


def test_lookup_follows_the_chain_up_to_the_limit() -> None:
    cache, events = _cache(8)
    cache.store([11, 12, 13], 0, ["a", "b", "c"], nbytes=10)
    assert events == [Stored(0, (11, 12, 13))] and cache.nbytes == 30
    assert cache.lookup([11, 12, 13, 14], 9, 16) == ["a", "b", "c"]
    assert cache.lookup([11, 12, 13], 2, 12) == ["a", "b"]
    assert cache.lookup([11, 99, 13], 9, 12) == ["a"]  # the chain stops at the first block missing
    assert cache.lookup([99, 12], 9, 8) == []
    assert cache.counters["lookup_tokens"] == 48 and cache.counters["hit_tokens"] == 4 * (3 + 2 + 1)


def test_a_continuation_is_stored_under_its_parent_and_held_blocks_are_not_published_again() -> None:
    cache, events = _cache(8)
    cache.store([11, 12], 0, ["a", "b"])
    cache.store([11, 12, 13, 14], 2, ["c", "d"])
    cache.store([11, 12, 13, 14], 0, ["x", "y", "z", "w"])  # all held: nothing new, data kept
    assert events == [Stored(0, (11, 12)), Stored(12, (13, 14))]
    assert cache.lookup([11, 12, 13, 14], 9, 16) == ["a", "b", "c", "d"]
    assert cache.counters["stored_blocks"] == 4


def test_lru_eviction_keeps_heads_and_publishes_removed() -> None:
    cache, events = _cache(4)
    cache.store([1, 2, 3], 0, ["1", "2", "3"])
    cache.store([7, 8], 0, ["7", "8"])  # one over: the least recently used is 3, the tail of the older prefix
    assert events[-2:] == [Stored(0, (7, 8)), Removed((3,))]
    cache.lookup([1, 2], 9, 8)  # touched: now 7's chain is the older one
    cache.store([5], 0, ["5"])
    assert events[-1] == Removed((8,))
    assert sorted(h for e in cache.snapshot() for h in e.block_hashes) == [1, 2, 5, 7]
    assert cache.counters["removed_blocks"] == 2


def test_a_prompt_longer_than_the_cache_keeps_its_head_and_publishes_only_that() -> None:
    cache, events = _cache(2)
    cache.store([1, 2, 3, 4], 0, ["1", "2", "3", "4"])
    assert events == [Stored(0, (1, 2))] and len(cache) == 2


def test_drop_adapter_clear_and_off() -> None:
    cache, events = _cache(8)
    cache.store([1, 2], 0, ["1", "2"], nbytes=5)
    cache.store([3], 0, ["3"], adapter="ad", nbytes=5)
    assert cache.drop_adapter("ad") == 1 and events[-1] == Removed((3,)) and cache.nbytes == 10
    assert cache.drop_adapter("ad") == 0 and events[-1] == Removed((3,))
    assert cache.clear() is True and events[-1] == Cleared() and len(cache) == 0 and cache.nbytes == 0
    off, off_events = _cache(0)
    off.store([1], 0, ["1"])
    assert not off.enabled and len(off) == 0 and off_events == []
    with pytest.raises(ValueError):
        PrefixCache(-1, 4)


def test_snapshot_puts_every_parent_before_its_children() -> None:
    cache, _ = _cache(16)
    cache.store([1, 2, 3], 0, ["1", "2", "3"])
    cache.store([1, 2, 5, 6], 2, ["5", "6"])
    cache.store([9], 0, ["9"])
    snap = cache.snapshot()
    seen = {0}
    for e in snap:
        assert isinstance(e, Stored) and e.parent_hash in seen
        seen.update(e.block_hashes)
    assert seen == {0, 1, 2, 3, 5, 6, 9}
    assert len(snap) == 4  # runs: (0: 1 2 3 or 1 2), the fork, and 9


def test_request_hashes_are_the_routers_chain() -> None:
    ids = tuple(range(100, 110))
    rows = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    req = GenerationRequest("r", [TokenSegment(ids), EmbedsSegment(rows)], SamplingParams(), resumed=(7, 8))
    assert request_hashes(req, 4) == block_hashes([ids, rows, (7, 8)], 4)
    assert request_hashes(req, 4, (9, 9, 9)) == block_hashes([ids, rows, (7, 8, 9, 9, 9)], 4)
    req.lora_adapter = "ad"
    assert request_hashes(req, 4) == adapter_block_hashes(block_hashes([ids, rows, (7, 8)], 4), "ad")
    assert request_hashes(req, 4) != block_hashes([ids, rows, (7, 8)], 4)


def test_the_collector_reads_the_figures_at_scrape_time() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from embedmesh.services.worker.engines.hf.prefix_cache import PrefixCacheCollector

    cache, _ = _cache(8)
    registry = CollectorRegistry()
    registry.register(PrefixCacheCollector(cache, "w1"))
    cache.store([1, 2, 3], 0, ["1", "2", "3"], nbytes=100)
    cache.lookup([1, 2, 9], 9, 12)
    held = generate_latest(registry).decode()
    assert 'embedmesh_hf_prefix_blocks{worker_id="w1"} 3.0' in held
    assert 'embedmesh_hf_prefix_bytes{worker_id="w1"} 300.0' in held
    cache.drop_adapter("")
    text = generate_latest(registry).decode()
    for line in ('embedmesh_hf_prefix_lookup_tokens_total{worker_id="w1"} 12.0',
                 'embedmesh_hf_prefix_hit_tokens_total{worker_id="w1"} 8.0',
                 'embedmesh_hf_prefix_stored_blocks_total{worker_id="w1"} 3.0',
                 'embedmesh_hf_prefix_removed_blocks_total{worker_id="w1"} 3.0',
                 'embedmesh_hf_prefix_blocks{worker_id="w1"} 0.0',
                 'embedmesh_hf_prefix_bytes{worker_id="w1"} 0.0'):
        assert line in text, line

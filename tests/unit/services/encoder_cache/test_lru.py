"""L1 semantics: bytes-bounded LRU, exact eviction order, refusal of oversized entries, expiry, stats."""

from __future__ import annotations

import pytest

from embedmesh.services.encoder_cache.lru import ByteLRU


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_eviction_is_least_recent_first_until_it_fits() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    for k in "abcd":
        assert lru.put(k, k, 25)
    assert lru.get("a") == "a"  # a becomes most recent: order b c d a
    assert lru.put("e", "e", 40)  # needs 40: evicts b (25) and c (25)
    assert lru.keys() == ["d", "a", "e"]
    assert lru.current_bytes == 90
    assert lru.counters.evictions == 2


def test_oversized_entry_is_refused_and_evicts_nothing() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    lru.put("a", "a", 60)
    assert not lru.put("huge", "x", 101)
    assert lru.keys() == ["a"] and lru.current_bytes == 60 and lru.counters.evictions == 0


def test_overwrite_replaces_the_size() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    lru.put("a", "v1", 70)
    lru.put("a", "v2", 20)
    assert lru.current_bytes == 20 and lru.get("a") == "v2" and len(lru) == 1
    lru.put("b", "b", 80)  # fits exactly with a's new size
    assert lru.keys() == ["a", "b"] and lru.counters.evictions == 0


def test_stats_by_hand() -> None:
    lru: ByteLRU[str] = ByteLRU(200)
    lru.put("a", "a", 50)
    lru.get("a")
    lru.get("a")
    lru.get("zz")
    assert (lru.counters.hits, lru.counters.misses) == (2, 1)
    assert lru.counters.hit_rate == pytest.approx(2 / 3)
    assert lru.utilization == pytest.approx(0.25)


def test_expired_entries_miss_and_free_their_bytes() -> None:
    clock = Clock()
    lru: ByteLRU[str] = ByteLRU(100, clock=clock)
    lru.put("a", "a", 30, ttl_seconds=10)
    clock.now = 9.9
    assert lru.get("a") == "a"
    clock.now = 10.0
    assert "a" not in lru
    assert lru.get("a") is None and lru.current_bytes == 0


def test_delete() -> None:
    lru: ByteLRU[str] = ByteLRU(100)
    lru.put("a", "a", 30)
    assert lru.delete("a") and not lru.delete("a") and lru.current_bytes == 0

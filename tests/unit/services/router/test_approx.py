"""Approximate tracking: routed blocks count as cached until their TTL or the per-worker bound forgets them."""

from __future__ import annotations

import pytest

from embedmesh.services.router.approx import ApproxTracker
from embedmesh.services.router.indexer import RadixIndexer


def test_routed_blocks_match_until_they_expire() -> None:
    idx = RadixIndexer()
    t = ApproxTracker(idx, ttl_seconds=10, max_blocks=100)
    t.routed("a", [1, 2, 3], now=0)
    assert idx.find_matches([1, 2, 3]) == {"a": 3}
    t.routed("a", [1, 2], now=5)  # touching refreshes 1 and 2, not 3
    assert t.expire(now=10) == 1
    assert idx.find_matches([1, 2, 3]) == {"a": 2}
    assert t.expire(now=14.9) == 0
    assert t.expire(now=15) == 2
    assert idx.find_matches([1]) == {} and t.tracked("a") == 0


def test_bound_forgets_least_recently_routed_first() -> None:
    idx = RadixIndexer()
    t = ApproxTracker(idx, ttl_seconds=100, max_blocks=3)
    t.routed("a", [1, 2], now=0)
    t.routed("a", [10, 11], now=1)
    assert t.tracked("a") == 3 and idx.find_matches([1]) == {} and idx.find_matches([2]) == {"a": 1}
    assert idx.find_matches([10, 11]) == {"a": 2}


def test_forget_and_validation() -> None:
    idx = RadixIndexer()
    t = ApproxTracker(idx, ttl_seconds=1)
    t.routed("a", [], now=0)
    assert t.tracked("a") == 0
    t.routed("a", [4], now=0)
    t.forget("a")
    assert t.expire(now=5) == 0
    with pytest.raises(ValueError):
        ApproxTracker(idx, ttl_seconds=0)

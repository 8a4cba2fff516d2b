"""A fleet on one machine: 8 mocker workers (separate processes, each with a simulated paged KV cache that
publishes KV events), the router, the preprocessor and the gateway, all started by the launcher. The same
shared-prefix workload (``tests/support/fleet.py``) goes through the router in KV-aware mode and in round-robin
mode; KV-aware routing must find far more of the prompts in the workers' caches (read from the workers, not the
router) and so answer sooner. Counts and ratios of one run, no wall-clock thresholds."""

from __future__ import annotations

import time

import pytest

from tests.support.fleet import (
    Result,
    Workload,
    drive,
    hit_rate,
    percentile,
    start_fleet,
    wait_registered,
    worker_counters,
)

pytestmark = pytest.mark.e2e

WORKERS = 8
WORKLOAD = Workload()


def run(mode: str) -> tuple[float, list[Result], dict[str, float]]:
    """The workload through a fresh fleet whose router runs in ``mode``: (hit rate, the second wave's results,
    the workers' counters)."""
    mesh = start_fleet(WORKERS, mode)
    try:
        wait_registered(str(mesh.extra["router"]), WORKERS)
        first, rest = WORKLOAD.waves()
        before = worker_counters(mesh, WORKERS)
        results = drive(mesh.base_url, "mocker", first, WORKLOAD.max_tokens, 8)
        time.sleep(0.5)  # the first wave's KV events reach the router
        results += drive(mesh.base_url, "mocker", rest, WORKLOAD.max_tokens, 8)
        after = worker_counters(mesh, WORKERS)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        return hit_rate(before, after), results[len(first):], after
    finally:
        mesh.stop()


def test_kv_aware_routing_beats_round_robin_on_a_cache_bound_fleet() -> None:
    kv_hit, kv, kv_counts = run("kv")
    rr_hit, rr, rr_counts = run("round-robin")
    w = WORKLOAD
    best = (w.per_group - 1) / w.per_group * w.prefix_tokens // 16 * 16 / (w.prefix_tokens + w.suffix_tokens)
    print(f"\nhit rate kv {kv_hit:.3f} (best possible {best:.3f}) rr {rr_hit:.3f}; "
          f"ttft p50 kv {percentile([r.ttft for r in kv], .5):.3f}s rr {percentile([r.ttft for r in rr], .5):.3f}s")
    assert kv_hit >= 0.9 * best, "KV-aware routing lost most of the reusable prefixes"
    assert kv_hit >= 3 * rr_hit, f"KV-aware routing no longer beats round robin: {kv_hit:.3f} vs {rr_hit:.3f}"
    assert kv_counts["removed"] < rr_counts["removed"], "round robin should thrash the small caches"
    # The cache is what makes time to first token: the same requests wait less behind KV-aware routing.
    assert percentile([r.ttft for r in kv], .5) < percentile([r.ttft for r in rr], .5)

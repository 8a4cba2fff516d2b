"""vLLM's scheduler figures as the worker keeps them (``MetricsRecorder``: gauges from the latest step, running
totals) and reads them at scrape time under the mesh's names (``VLLMCollector``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embedmesh.services.worker.engines.vllm.metrics import MetricsRecorder, VLLMCollector, VLLMEngineMetrics


@dataclass
class _PC:
    queries: int
    hits: int


@dataclass
class _Sched:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: _PC
    num_skipped_waiting_reqs: int = 0


@dataclass
class _Iter:
    num_preempted_reqs: int


def test_metrics_recorder_keeps_gauges_and_totals() -> None:
    m = MetricsRecorder()
    m.record(_Sched(2, 1, 0.25, _PC(256, 128)), _Iter(0))
    m.record(_Sched(1, 0, 0.5, _PC(100, 0), num_skipped_waiting_reqs=2), _Iter(1))
    m.record(None, None)
    s = m.latest
    assert (s.num_running, s.num_waiting, s.kv_usage) == (1, 2, 0.5)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.preemptions, s.steps) == (356, 128, 1, 2)


def test_iteration_stats_alone_count_preemptions_and_keep_the_gauges() -> None:
    m = MetricsRecorder()
    m.record(_Sched(3, 4, 0.75, _PC(10, 5)), None)
    m.record(None, _Iter(2))
    m.record(None, object())  # an iteration without the field counts nothing
    assert m.latest == VLLMEngineMetrics(num_running=3, num_waiting=4, kv_usage=0.75, prefix_cache_queries=10,
                                         prefix_cache_hits=5, preemptions=2, steps=1)


def _samples(collector: VLLMCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], Any]:
    out = {}
    for family in collector.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = (family.type, s.value)
    return out


def test_the_collector_reads_the_latest_figures_at_scrape_time() -> None:
    latest = [VLLMEngineMetrics(num_running=2, num_waiting=1, kv_usage=0.5, prefix_cache_queries=9,
                                prefix_cache_hits=4, preemptions=3, steps=7)]
    counters = {"stored": 5, "removed": 2}
    collector = VLLMCollector(lambda: latest[0], lambda: counters, "w-1")
    w = (("worker_id", "w-1"),)
    got = _samples(collector)
    assert got[("embedmesh_vllm_num_running", w)] == ("gauge", 2)
    assert got[("embedmesh_vllm_num_waiting", w)] == ("gauge", 1)
    assert got[("embedmesh_vllm_kv_usage", w)] == ("gauge", 0.5)
    assert got[("embedmesh_vllm_prefix_cache_queries_total", w)] == ("counter", 9)
    assert got[("embedmesh_vllm_prefix_cache_hits_total", w)] == ("counter", 4)
    assert got[("embedmesh_vllm_preemptions_total", w)] == ("counter", 3)
    assert got[("embedmesh_vllm_kv_events_total", (("what", "removed"), ("worker_id", "w-1")))] == ("counter", 2)
    assert got[("embedmesh_vllm_kv_events_total", (("what", "stored"), ("worker_id", "w-1")))] == ("counter", 5)
    # Read again at the next scrape: nothing cached.
    latest[0] = VLLMEngineMetrics(num_running=5)
    assert _samples(collector)[("embedmesh_vllm_num_running", w)] == ("gauge", 5)


def test_no_kv_event_family_before_any_event() -> None:
    names = {f.name for f in VLLMCollector(VLLMEngineMetrics, dict, "w").collect()}
    assert "embedmesh_vllm_kv_events" not in names and "embedmesh_vllm_num_running" in names

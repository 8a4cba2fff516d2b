"""vLLM's scheduler figures (running, waiting, KV usage, prefix-cache queries and hits) as the worker sees them.

A stat logger handed to ``AsyncLLM`` keeps the latest scheduler stats and running totals; vLLM calls it after
every engine step, on the worker's event loop. The Prometheus collector reads those at scrape time (one source of
truth, nothing on the hot path) under the mesh's own names, beside vLLM's ``vllm:*`` metrics, which its own
logger registers in the same process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["VLLMEngineMetrics", "MetricsRecorder", "VLLMCollector"]


@dataclass(frozen=True)
class VLLMEngineMetrics:
    """What vLLM's scheduler reported last (gauges) and since start (totals)."""

    num_running: int = 0
    """Sequences in the running batch."""
    num_waiting: int = 0
    """Sequences queued for a batch slot."""
    kv_usage: float = 0.0
    """Fraction of KV cache blocks in use, 0..1."""
    prefix_cache_queries: int = 0
    """Prompt positions looked up in the prefix cache (total)."""
    prefix_cache_hits: int = 0
    """Prompt positions found there (total)."""
    preemptions: int = 0
    """Sequences preempted for lack of KV blocks (total)."""
    steps: int = 0
    """Engine steps recorded."""


class MetricsRecorder:
    """Collects vLLM's stats; ``factory`` is what ``AsyncLLM.from_engine_args(stat_loggers=[...])`` takes."""

    def __init__(self) -> None:
        self.latest = VLLMEngineMetrics()

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        m = self.latest
        if scheduler_stats is not None:
            pc = scheduler_stats.prefix_cache_stats
            m = replace(m, num_running=int(scheduler_stats.num_running_reqs),
                        num_waiting=int(scheduler_stats.num_waiting_reqs
                                        + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)),
                        kv_usage=float(scheduler_stats.kv_cache_usage),
                        prefix_cache_queries=m.prefix_cache_queries + int(pc.queries),
                        prefix_cache_hits=m.prefix_cache_hits + int(pc.hits), steps=m.steps + 1)
        if iteration_stats is not None:
            m = replace(m, preemptions=m.preemptions + int(getattr(iteration_stats, "num_preempted_reqs", 0)))
        self.latest = m

    def factory(self) -> Callable[..., Any]:
        """A vLLM ``StatLoggerFactory`` feeding this recorder (vLLM is imported only here, in its venv)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                recorder.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


class VLLMCollector:
    """The recorder's figures and the KV event translator's counters, read at scrape time (``prometheus_client``
    collector; the engine's ``metrics_collector``, registered by the worker)."""

    def __init__(self, read: Callable[[], VLLMEngineMetrics], kv_counters: Callable[[], dict[str, int]],
                 worker_id: str) -> None:
        self.read = read
        self.kv_counters = kv_counters
        self.worker_id = worker_id

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        worker_id = self.worker_id
        m = self.read()
        for name, doc, value in (
            ("embedmesh_vllm_num_running", "Sequences in vLLM's running batch", m.num_running),
            ("embedmesh_vllm_num_waiting", "Sequences waiting in vLLM's queue", m.num_waiting),
            ("embedmesh_vllm_kv_usage", "Fraction of vLLM's KV cache blocks in use (0..1)", m.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["worker_id"])
            g.add_metric([worker_id], value)
            yield g
        for name, doc, value in (
            ("embedmesh_vllm_prefix_cache_queries", "Prompt positions looked up in vLLM's prefix cache",
             m.prefix_cache_queries),
            ("embedmesh_vllm_prefix_cache_hits", "Prompt positions found in vLLM's prefix cache",
             m.prefix_cache_hits),
            ("embedmesh_vllm_preemptions", "Sequences vLLM preempted for lack of KV blocks", m.preemptions),
        ):
            c = CounterMetricFamily(name, doc, labels=["worker_id"])
            c.add_metric([worker_id], value)
            yield c
        counters = self.kv_counters()
        if counters:
            c = CounterMetricFamily("embedmesh_vllm_kv_events", "vLLM KV events translated for the router",
                                    labels=["worker_id", "what"])
            for what, value in sorted(counters.items()):
                c.add_metric([worker_id, what], value)
            yield c

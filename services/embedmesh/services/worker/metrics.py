"""Prometheus view of a worker's engine: read from ``Engine.stats()`` at scrape time, so there is one source of
truth and nothing to keep in sync on the hot path."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from embedmesh.services.worker.engines.base import Engine

__all__ = ["register_engine_metrics"]


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.engine.stats()
        labels = ["worker_id"]
        values = [self.worker_id]
        for name, doc, value in (
            ("embedmesh_worker_active_requests", "Sequences generating or queued", s.active_requests),
            ("embedmesh_worker_queued_requests", "Sequences waiting for a batch slot", s.queued_requests),
            ("embedmesh_worker_max_batch_size_seen", "Largest decode batch so far", s.max_batch_seen),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (
            ("embedmesh_worker_completed_requests", "Sequences finished (length or stop)", s.completed_requests),
            ("embedmesh_worker_aborted_requests", "Sequences aborted (client gone or Abort)", s.aborted_requests),
            ("embedmesh_worker_generated_tokens", "Tokens generated", s.generated_tokens),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c


def register_engine_metrics(engine: Engine, worker_id: str) -> None:
    """The worker's view of any engine, plus the engine's own figures where it offers them
    (``Engine.metrics_collector``)."""
    REGISTRY.register(_EngineCollector(engine, worker_id))
    own = engine.metrics_collector(worker_id)
    if own is not None:
        REGISTRY.register(own)

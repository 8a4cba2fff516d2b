"""The worker's Prometheus view of its engine (``worker/metrics.py``): read from ``Engine.stats()`` at scrape time
under the worker's id, plus the engine's own collector where it offers one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from embedmesh.services.worker import metrics
from embedmesh.services.worker.engines.base import EngineStats
from embedmesh.services.worker.engines.echo.engine import EchoEngine


class _Own:
    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("embedmesh_test_engine_own", "x", labels=["worker_id"])
        g.add_metric(["w-1"], 42)
        yield g


class _Engine(EchoEngine):
    def __init__(self, own: bool) -> None:
        super().__init__()
        self.figures = EngineStats(1, 2, 3, 4, 5, 6)
        self.own = own

    def stats(self) -> EngineStats:
        return self.figures

    def metrics_collector(self, worker_id: str) -> Any:
        return _Own() if self.own else None


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> CollectorRegistry:
    r = CollectorRegistry()
    monkeypatch.setattr(metrics, "REGISTRY", r)
    return r


def test_engine_stats_are_read_at_scrape_time(registry: CollectorRegistry) -> None:
    engine = _Engine(own=False)
    metrics.register_engine_metrics(engine, "w-1")

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"worker_id": "w-1"})

    assert [value(n) for n in ("embedmesh_worker_active_requests", "embedmesh_worker_queued_requests",
                               "embedmesh_worker_completed_requests_total", "embedmesh_worker_aborted_requests_total",
                               "embedmesh_worker_generated_tokens_total", "embedmesh_worker_max_batch_size_seen")] == [
        1, 2, 3, 4, 5, 6]
    engine.figures = EngineStats(active_requests=9, generated_tokens=70)
    assert value("embedmesh_worker_active_requests") == 9 and value("embedmesh_worker_generated_tokens_total") == 70
    assert value("embedmesh_test_engine_own") is None


def test_the_engines_own_collector_is_registered_beside(registry: CollectorRegistry) -> None:
    metrics.register_engine_metrics(_Engine(own=True), "w-1")
    assert registry.get_sample_value("embedmesh_test_engine_own", {"worker_id": "w-1"}) == 42
    assert registry.get_sample_value("embedmesh_worker_active_requests", {"worker_id": "w-1"}) == 1

"""The router's Prometheus metrics (and the route client's fallback counter, counted in the preprocessor), in one
place: names and labels are what operators' dashboards read."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["DECISIONS", "OVERLAP", "MATCHED_BLOCKS", "FALLBACKS", "RESYNCS", "EVENTS", "WORKERS", "INDEX_BLOCKS",
           "DROPS"]

DECISIONS = Counter("embedmesh_router_decisions_total",
                    "Route decisions by model and whether the chosen worker held any prefix block", ["model", "hit"])
OVERLAP = Histogram("embedmesh_router_overlap_ratio", "Cached prefix blocks / prompt blocks of the chosen worker",
                    ["model"], buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
MATCHED_BLOCKS = Counter("embedmesh_router_prefix_blocks_total",
                         "Prompt blocks routed, and how many the chosen worker already held", ["model", "kind"])
FALLBACKS = Counter("embedmesh_router_fallback_total", "Requests routed round robin because no router answered",
                    ["reason"])
RESYNCS = Counter("embedmesh_router_resyncs_total", "Re-syncs asked of workers after an event-id gap")
EVENTS = Counter("embedmesh_router_kv_events_total", "KV events applied to the index, by kind", ["kind"])
WORKERS = Gauge("embedmesh_router_workers", "Live registered workers")
INDEX_BLOCKS = Gauge("embedmesh_router_index_blocks", "Indexed blocks: distinct nodes and (worker, block) pairs",
                     ["kind"])
DROPS = Counter("embedmesh_router_worker_drops_total", "Workers dropped from routing, by cause", ["cause"])

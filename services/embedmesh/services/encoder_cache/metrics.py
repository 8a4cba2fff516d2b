"""The encoder cache's Prometheus metrics (tier lookups, L2 health), in one place."""

from __future__ import annotations

from prometheus_client import Counter

__all__ = ["LOOKUPS", "L2_DOWN", "L2_REJECTED", "L2_CORRUPTED"]

LOOKUPS = Counter("embedmesh_encoder_cache_lookups_total", "Cache lookups by tier and result", ["tier", "result"])
L2_DOWN = Counter("embedmesh_encoder_cache_l2_unavailable_total", "L2 operations skipped because Redis was away")
L2_REJECTED = Counter("embedmesh_encoder_cache_l2_rejected_total",
                      "L2 commands Redis refused while reachable (e.g. OOM at maxmemory)", ["op"])
L2_CORRUPTED = Counter("embedmesh_encoder_cache_l2_corrupted_total",
                       "L2 values dropped because their header, length or integrity digest was wrong")

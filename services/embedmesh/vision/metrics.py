"""The encode stage's Prometheus metrics (names are part of the operators' dashboards)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

__all__ = ["IMAGE_ENCODES", "IMAGE_CACHE_HITS", "IMAGE_ENCODE_SECONDS"]

IMAGE_ENCODES = Counter("embedmesh_image_encodes_total", "Images run through the vision tower and projector "
                        "(encoder cache misses)", ["encoder"])
IMAGE_CACHE_HITS = Counter("embedmesh_image_cache_hits_total", "Images whose rows came from the encoder cache",
                           ["encoder"])
IMAGE_ENCODE_SECONDS = Histogram("embedmesh_image_encode_seconds", "Time to encode one image (tower + projector)",
                                 ["encoder"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))

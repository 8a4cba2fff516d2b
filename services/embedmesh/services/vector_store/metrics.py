"""The vector store's Prometheus metrics (ingestion), in one place."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["FILES_INGESTED", "INGESTION_SECONDS", "CHUNKS_INDEXED", "IN_PROGRESS"]

FILES_INGESTED = Counter("embedmesh_vector_store_files_ingested_total",
                         "Store-file ingestions ended, by outcome (completed, failed, cancelled)", ["status"])
INGESTION_SECONDS = Histogram("embedmesh_vector_store_ingestion_duration_seconds",
                              "Chunk + embed + commit time of one file (completed or failed)",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
CHUNKS_INDEXED = Counter("embedmesh_vector_store_chunks_indexed_total", "Chunks embedded and committed to a store")
IN_PROGRESS = Gauge("embedmesh_vector_store_ingestions_in_progress", "Store-file ingestions queued or running")

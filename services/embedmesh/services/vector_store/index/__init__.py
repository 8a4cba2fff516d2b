"""Index backends: ``EmbeddedIndex`` (hnswlib on disk, the default) and ``PgVectorIndex`` (PostgreSQL + pgvector)."""

from embedmesh.services.vector_store.index.base import Hit, VectorIndex

__all__ = ["VectorIndex", "Hit"]

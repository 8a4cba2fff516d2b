"""The vector store service: OpenAI Files + Vector Stores over the mesh's embeddings, with an embedded hnswlib
index on disk (default) or PostgreSQL + pgvector."""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported
from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.services.vector_store.vector_stores import VectorStores, build

__all__ = ["VectorStoreConfig", "VectorStores", "build"]

"""Vector store configuration: one typed dataclass; CLI flags and ``EMBEDMESH_VECTOR_STORE_*`` env vars are read
here only.

Each field is a flag ``--field-name`` and a variable ``EMBEDMESH_VECTOR_STORE_<FIELD>`` (``embedmesh.core.config``;
``--help`` lists them); ``EMBEDMESH_PREPROCESSOR_ADDR`` and ``--no-requeue`` / ``EMBEDMESH_VECTOR_STORE_NO_REQUEUE``
keep working.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from embedmesh.core.config import Settings, inverse, option

__all__ = ["VectorStoreConfig", "BACKENDS"]

MiB = 1024 * 1024
BACKENDS = ("embedded", "pgvector")


@dataclass(frozen=True)
class VectorStoreConfig(Settings, service="vector_store", prog="embedmesh-vector-store",
                        description="Run the embedmesh vector store."):
    """OpenAI Files + Vector Stores: the backend, the embedding model it calls, chunking and index settings."""

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50101
    """gRPC port (0 = any free port)."""
    data_dir: str = "~/.cache/embedmesh/vector_store"
    """Folder of the embedded backend: the SQLite database (metadata, files, chunks) and one HNSW index per store."""
    backend: str = option("embedded", choices=BACKENDS)
    """"embedded" (SQLite + hnswlib on disk) or "pgvector" (everything in PostgreSQL, HNSW cosine index)."""
    postgres_dsn: str = ""
    """libpq connection string of the pgvector backend (e.g. "host=127.0.0.1 port=5432 user=postgres dbname=x")."""
    inference_addr: str = option("127.0.0.1:50051", aliases=("EMBEDMESH_PREPROCESSOR_ADDR",))
    """Address of the mesh's InferenceService (the preprocessor), whose Embed turns text into vectors."""
    embedding_model: str = "all-MiniLM-L6-v2"
    """Embedding model name passed to Embed; stores record it."""
    dimensions: int = 384
    """Size of the model's vectors; the index is built for it and any other size is refused."""
    tokenizer: str = "auto"
    """Token counting for chunking: "auto" (the embedding model's tokenizer.json when installed, else the
    approximation), "approx" (one token per word or punctuation mark), or a path to a tokenizer.json."""
    embed_batch_size: int = 32
    """Chunks per Embed call."""
    max_file_bytes: int = 64 * MiB
    """Largest file accepted by UploadFile."""
    max_concurrent_ingestions: int = 2
    """Files chunked and embedded at the same time."""
    hnsw_m: int = 16
    """Embedded index: HNSW graph degree."""
    hnsw_ef_construction: int = 200
    """Embedded index: candidate list size while building."""
    hnsw_ef_search: int = 128
    """Search candidate list size (embedded and pgvector); measured recall@10 >= 0.98 at 100k (bench)."""
    exact_search_below: int = 2048
    """Embedded index: a filtered search whose files hold at most this many chunks is computed exactly."""
    index_flush_seconds: float = 5.0
    """Embedded index: how often changed indexes are written to disk (and always on shutdown)."""
    requeue_on_start: bool = option(True, flags=("--requeue",),
                                    aliases=(inverse("EMBEDMESH_VECTOR_STORE_NO_REQUEUE"),))
    """Files found in progress at start-up (the service died mid-ingestion) are ingested again; off
    (``--no-requeue``) = marked failed."""
    max_message_bytes: int = 512 * MiB
    """Largest gRPC message accepted or sent."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "pgvector" and not self.postgres_dsn:
            raise ValueError("the pgvector backend needs postgres_dsn")
        if not 1 <= self.dimensions <= 16000:
            raise ValueError("dimensions must be in [1, 16000]")
        if not 1 <= self.embed_batch_size <= 1024:
            raise ValueError("embed_batch_size must be in [1, 1024]")
        if self.max_file_bytes < 1:
            raise ValueError("max_file_bytes must be >= 1")
        if self.max_concurrent_ingestions < 1:
            raise ValueError("max_concurrent_ingestions must be >= 1")
        if self.hnsw_m < 2 or self.hnsw_ef_construction < 1 or self.hnsw_ef_search < 1:
            raise ValueError("hnsw_m must be >= 2, ef values >= 1")
        if self.index_flush_seconds <= 0:
            raise ValueError("index_flush_seconds must be > 0")

    @property
    def data_path(self) -> str:
        return os.path.expanduser(self.data_dir)

    def describe(self) -> dict[str, object]:
        out = asdict(self)
        if self.postgres_dsn:
            out["postgres_dsn"] = "<set>"  # may hold a password
        return out

"""The vector store's operations (OpenAI Files + Vector Stores semantics) over the metadata store, the index, the
ingestor and the embedder. The gRPC servicer only converts to and from these calls.

Search: each query string is embedded (after ``rewrite_query``'s normalisation: whitespace collapsed and trimmed,
nothing else), each is searched for ``max_num_results`` chunks, results are merged by best score per chunk.
``score`` is the cosine similarity clamped to [0, 1]; ``ranker`` ("auto", "default-2024-11-15", "none") is accepted
and every value ranks by that score; ``score_threshold`` drops results below it.

Tenancy: every operation acts for the tenant of the RPC being served (``embedmesh.core.auth.current_tenant``, set
by the server from the caller's API key) and passes it to every metadata-store call; another tenant's file, vector
store or batch id is answered exactly as an unknown one (NotFound).
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import numpy as np

from embedmesh.core.auth import current_tenant
from embedmesh.core.errors import FailedPrecondition, InvalidArgument
from embedmesh.core.logs import get_logger
from embedmesh.services.vector_store.chunking import TokenCounter, check_chunking, load_tokenizer
from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.embedder import Embedder
from embedmesh.services.vector_store.files import check_purpose, decode_text, detect_media_type
from embedmesh.services.vector_store.filters import Filter, check_attributes, evaluate, validate
from embedmesh.services.vector_store.index.base import VectorIndex
from embedmesh.services.vector_store.ingest import Ingestor
from embedmesh.services.vector_store.objects import (
    AUTO_CHUNKING,
    Attributes,
    ChunkingSpec,
    ExpiresAfter,
    FileBatch,
    FileObject,
    FileStatus,
    Page,
    PageRequest,
    SearchHit,
    VectorStore,
    VectorStoreFile,
)
from embedmesh.services.vector_store.store import MetadataStore, now

__all__ = ["VectorStores", "BatchItem", "build"]

log = get_logger(__name__)

RANKERS = ("", "auto", "default-2024-11-15", "none")
MAX_RESULTS = 50
MAX_QUERIES = 16
MAX_METADATA = 16
SEARCH_TOUCH_SECONDS = 60
"""A search records activity (expiry counts from it) when the last record is at least this old."""

BatchItem = tuple[str, Attributes, ChunkingSpec | None]


def _check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA:
        raise InvalidArgument(f"metadata: at most {MAX_METADATA} pairs, got {len(metadata)}", field="metadata",
                              reason="TOO_MANY_METADATA")
    for k, v in metadata.items():
        if not k or len(k) > 64 or len(v) > 512:
            raise InvalidArgument(f"metadata.{k}: keys have 1-64 characters and values at most 512",
                                  field=f"metadata.{k}", reason="INVALID_METADATA")
    return metadata


def _check_expires(e: ExpiresAfter | None) -> ExpiresAfter | None:
    if e is None:
        return None
    if e.anchor != "last_active_at":
        raise InvalidArgument(f"expires_after.anchor must be 'last_active_at', got {e.anchor!r}",
                              field="expires_after.anchor", reason="INVALID_ANCHOR")
    if not 1 <= e.days <= 365:
        raise InvalidArgument(f"expires_after.days must be in [1, 365], got {e.days}", field="expires_after.days",
                              reason="DAYS_OUT_OF_RANGE")
    return e


def rewrite(query: str) -> str:
    """``rewrite_query``: collapse runs of whitespace and trim. Nothing else is rewritten."""
    return re.sub(r"\s+", " ", query).strip()


class VectorStores:
    def __init__(self, store: MetadataStore, index: VectorIndex, embedder: Embedder, tokenizer: TokenCounter,
                 config: VectorStoreConfig) -> None:
        self.store = store
        self.db = store.db
        self.index = index
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.config = config
        self.ingestor = Ingestor(store, index, embedder, tokenizer, config.max_concurrent_ingestions)
        self._one_hop = store.db.has_readers and type(index).search_now is not VectorIndex.search_now
        """Unfiltered searches run their index search and row reads in one thread (SQLite + the embedded graph)."""

    async def start(self) -> int:
        """Open the index and re-queue files a previous process left in progress; returns how many."""
        await self.index.open()
        return await self.ingestor.requeue(self.config.requeue_on_start)

    async def close(self) -> None:
        await self.ingestor.close()
        await self.index.close()
        await self.embedder.close()
        self.db.close()

    # --- files --------------------------------------------------------------------------------------------------
    async def upload_file(self, filename: str, purpose: str, content_type: str, content: bytes) -> FileObject:
        check_purpose(purpose)
        if not filename:
            raise InvalidArgument("filename is required", field="filename", reason="MISSING_FILENAME")
        if len(content) > self.config.max_file_bytes:
            raise InvalidArgument(f"file: {len(content)} bytes is over the {self.config.max_file_bytes} byte limit",
                                  field="file", reason="FILE_TOO_LARGE")
        media = detect_media_type(filename, content_type)
        decode_text(content, media)
        return await self.db.run(self.store.create_file, current_tenant(), os.path.basename(filename), purpose,
                                 media, content)

    async def list_files(self, purpose: str, page: PageRequest) -> Page[FileObject]:
        return await self.db.run(self.store.list_files, current_tenant(), purpose, page)

    async def get_file(self, file_id: str) -> FileObject:
        return await self.db.run(self.store.get_file, current_tenant(), file_id)

    async def file_content(self, file_id: str) -> bytes:
        return await self.db.run(self.store.file_content, current_tenant(), file_id)

    async def delete_file(self, file_id: str) -> None:
        tenant = current_tenant()
        await self.db.run(self.store.get_file, tenant, file_id)
        self.ingestor.cancel_file(file_id)
        for store_id, ids in await self.db.run(self.store.delete_file, tenant, file_id):
            await self.index.removed(store_id, ids)

    # --- stores -------------------------------------------------------------------------------------------------
    async def create_store(self, name: str, file_ids: list[str], chunking: ChunkingSpec | None,
                           expires: ExpiresAfter | None, metadata: dict[str, str]) -> VectorStore:
        tenant = current_tenant()
        _check_metadata(metadata)
        _check_expires(expires)
        spec = check_chunking(chunking or AUTO_CHUNKING)
        for i, fid in enumerate(file_ids):
            await self.db.run(self.store.get_file, tenant, fid, f"file_ids[{i}]")
        store_id = await self.db.run(self.store.create_store, tenant, name, expires, metadata)
        for fid in dict.fromkeys(file_ids):
            await self._add(tenant, store_id, fid, {}, spec, None)
        return await self.get_store(store_id)

    async def list_stores(self, page: PageRequest) -> Page[VectorStore]:
        return await self.db.run(self.store.list_stores, current_tenant(), page)

    async def get_store(self, store_id: str) -> VectorStore:
        return await self.db.run(self.store.get_store, current_tenant(), store_id)

    async def update_store(self, store_id: str, name: str | None, expires: ExpiresAfter | None,
                           clear_expires: bool, metadata: dict[str, str] | None) -> VectorStore:
        if metadata is not None:
            _check_metadata(metadata)
        _check_expires(expires)
        return await self.db.run(self.store.update_store, current_tenant(), store_id, name, expires, clear_expires,
                                 metadata)

    async def delete_store(self, store_id: str) -> None:
        tenant = current_tenant()
        await self.get_store(store_id)
        self.ingestor.cancel_store(store_id)
        await self.db.run(self.store.delete_store, tenant, store_id)
        await self.index.dropped(store_id)

    # --- files in a store ---------------------------------------------------------------------------------------
    # Each operation finds the store for the caller's tenant first (NotFound otherwise); the store-file calls after
    # it are keyed by that store.
    async def _add(self, tenant: str, store_id: str, file_id: str, attributes: Attributes, chunking: ChunkingSpec,
                   batch_id: str | None) -> VectorStoreFile:
        sf, pending, removed = await self.db.run(self.store.add_store_file, tenant, store_id, file_id, chunking,
                                                 attributes, batch_id)
        if removed:
            await self.index.removed(store_id, removed)
        self.ingestor.submit(pending)
        return sf

    async def add_file(self, store_id: str, file_id: str, attributes: Attributes,
                       chunking: ChunkingSpec | None) -> VectorStoreFile:
        tenant = current_tenant()
        await self.get_store(store_id)
        await self.db.run(self.store.get_file, tenant, file_id)
        check_attributes(attributes)
        return await self._add(tenant, store_id, file_id, attributes, check_chunking(chunking or AUTO_CHUNKING),
                               None)

    async def list_store_files(self, store_id: str, status: FileStatus | None,
                               page: PageRequest) -> Page[VectorStoreFile]:
        await self.get_store(store_id)
        return await self.db.run(self.store.list_store_files, store_id, status, page)

    async def get_store_file(self, store_id: str, file_id: str) -> VectorStoreFile:
        await self.get_store(store_id)
        return await self.db.run(self.store.get_store_file, store_id, file_id)

    async def update_store_file(self, store_id: str, file_id: str, attributes: Attributes) -> VectorStoreFile:
        await self.get_store(store_id)
        check_attributes(attributes)
        return await self.db.run(self.store.update_attributes, store_id, file_id, attributes)

    async def delete_store_file(self, store_id: str, file_id: str) -> None:
        await self.get_store(store_id)
        self.ingestor.cancel(store_id, file_id)
        removed = await self.db.run(self.store.delete_store_file, store_id, file_id)
        await self.index.removed(store_id, removed)

    # --- batches ------------------------------------------------------------------------------------------------
    async def create_batch(self, store_id: str, items: list[BatchItem]) -> FileBatch:
        tenant = current_tenant()
        await self.get_store(store_id)
        if not items:
            raise InvalidArgument("file_ids: a batch needs at least one file", field="file_ids",
                                  reason="EMPTY_BATCH")
        resolved = []
        for i, (fid, attrs, chunking) in enumerate(items):
            await self.db.run(self.store.get_file, tenant, fid, f"file_ids[{i}]")
            check_attributes(attrs, f"files[{i}].attributes")
            resolved.append((fid, attrs, check_chunking(chunking or AUTO_CHUNKING)))
        batch_id = await self.db.run(self.store.create_batch, tenant, store_id)
        for fid, attrs, spec in resolved:
            await self._add(tenant, store_id, fid, attrs, spec, batch_id)
        return await self.db.run(self.store.get_batch, tenant, store_id, batch_id)

    async def get_batch(self, store_id: str, batch_id: str) -> FileBatch:
        await self.get_store(store_id)
        return await self.db.run(self.store.get_batch, current_tenant(), store_id, batch_id)

    async def cancel_batch(self, store_id: str, batch_id: str) -> FileBatch:
        tenant = current_tenant()
        await self.get_store(store_id)
        for fid in await self.db.run(self.store.cancel_batch, tenant, store_id, batch_id):
            self.ingestor.cancel(store_id, fid)
        return await self.db.run(self.store.get_batch, tenant, store_id, batch_id)

    async def list_batch_files(self, store_id: str, batch_id: str, status: FileStatus | None,
                               page: PageRequest) -> Page[VectorStoreFile]:
        await self.get_batch(store_id, batch_id)
        return await self.db.run(self.store.list_store_files, store_id, status, page, batch_id)

    # --- search -------------------------------------------------------------------------------------------------
    async def search(self, store_id: str, queries: list[str], query_vector: np.ndarray | None, flt: Filter | None,
                     max_num_results: int, ranker: str, score_threshold: float | None,
                     rewrite_query: bool) -> tuple[list[str], list[SearchHit]]:
        """(queries as searched, hits best first)."""
        if not 1 <= max_num_results <= MAX_RESULTS:
            raise InvalidArgument(f"max_num_results must be in [1, {MAX_RESULTS}], got {max_num_results}",
                                  field="max_num_results", reason="MAX_NUM_RESULTS_OUT_OF_RANGE")
        if ranker not in RANKERS:
            raise InvalidArgument(f"ranking_options.ranker must be one of {', '.join(r for r in RANKERS if r)}, "
                                  f"got {ranker!r}", field="ranking_options.ranker", reason="INVALID_RANKER")
        if score_threshold is not None and not 0.0 <= score_threshold <= 1.0:
            raise InvalidArgument(f"ranking_options.score_threshold must be in [0, 1], got {score_threshold}",
                                  field="ranking_options.score_threshold", reason="THRESHOLD_OUT_OF_RANGE")
        if flt is not None:
            validate(flt)
        if query_vector is not None and flt is None and self._one_hop:
            found = await asyncio.to_thread(self._vector_search_now, current_tenant(), store_id, queries,
                                            query_vector, max_num_results, score_threshold)
            if found is not None:  # the whole search in one thread hop (see _vector_search_now)
                await self._touched(found[0])
                return [], found[1]
        store = await self.get_store(store_id)
        _searchable(store)
        vectors = await self._query_vectors(store, queries, query_vector, rewrite_query)
        searched = [rewrite(q) for q in queries] if rewrite_query else list(queries)
        allowed: dict[str, int] | None = None
        if flt is not None and not self.index.pushes_down_filters:
            files = await self.db.run(self.store.completed_files, store_id)
            allowed = {fid: n for fid, attrs, n in files if evaluate(flt, attrs)}
        hits: list[SearchHit] | None = None
        if flt is None and self._one_hop:  # the index searched and the rows read in one thread hop
            hits = await asyncio.to_thread(self._hits_now, store_id, vectors, max_num_results, score_threshold)
        if hits is None:
            ranked = _ranked([await self.index.search(store_id, v, max_num_results, flt, allowed) for v in vectors])
            rows = await self.db.run(self.store.chunk_rows, store_id, [cid for cid, _ in ranked])
            hits = _hits(ranked, rows, max_num_results, score_threshold)
        await self._touched(store)
        return searched, hits

    async def _touched(self, store: VectorStore) -> None:
        """A search keeps its store active (``last_active_at``, what expiry counts from): written at most once a
        ``SEARCH_TOUCH_SECONDS`` (touch_store's own test, without a db round trip when it is not due)."""
        if now() - store.last_active_at >= SEARCH_TOUCH_SECONDS:
            await self.db.run(self.store.touch_store, store.id, SEARCH_TOUCH_SECONDS)

    def _vector_search_now(self, tenant: str, store_id: str, queries: list[str], vector: np.ndarray, k: int,
                           score_threshold: float | None) -> tuple[VectorStore, list[SearchHit]] | None:
        """A search by ``query_embedding`` without a filter, whole, in the calling thread: the store looked up,
        the vector checked, the index searched and the chunk rows read — the same checks and errors in the same
        order as the hop-by-hop path — when the database gives this thread a reader and the index can search in it
        (SQLite + the embedded graph, loaded); None otherwise (then searched hop by hop). One thread hand-off
        instead of three (~0.1 ms each)."""
        store = self._reader_store()
        if store is None:
            return None
        found = store.get_store(tenant, store_id)
        _searchable(found)
        v = _vector_query(found, queries, vector)
        hits = self._hits_now(store_id, v, k, score_threshold, store)
        return None if hits is None else (found, hits)

    def _hits_now(self, store_id: str, vectors: np.ndarray, k: int, score_threshold: float | None,
                  store: MetadataStore | None = None) -> list[SearchHit] | None:
        """Unfiltered hits of ``vectors`` in the calling thread: the index searched (``search_now``) and the rows read
        on this thread's reader; None when the index or the database cannot do that here."""
        store = store or self._reader_store()
        if store is None:
            return None
        found: list[list[tuple[int, float]]] = []
        for v in vectors:
            hits = self.index.search_now(store_id, v, k)
            if hits is None:
                return None
            found.append(hits)
        ranked = _ranked(found)
        return _hits(ranked, store.chunk_rows(store_id, [cid for cid, _ in ranked]), k, score_threshold)

    def _reader_store(self) -> MetadataStore | None:
        """The metadata store on the calling thread's own read-only connection (``Database.reading``), if any."""
        reader = self.db.reading()
        return None if reader is None else MetadataStore(reader, self.store.dimensions, self.store.embedding_model)

    async def _query_vectors(self, store: VectorStore, queries: list[str], vector: np.ndarray | None,
                             rewrite_query: bool) -> np.ndarray:
        if vector is not None:
            return _vector_query(store, queries, vector)
        if not queries:
            raise InvalidArgument("query: a non-empty string or list of strings is required", field="query",
                                  reason="MISSING_QUERY")
        if len(queries) > MAX_QUERIES:
            raise InvalidArgument(f"query: at most {MAX_QUERIES} strings, got {len(queries)}", field="query",
                                  reason="TOO_MANY_QUERIES")
        texts = []
        for i, q in enumerate(queries):
            t = rewrite(q) if rewrite_query else q
            if not t.strip():
                name = "query" if len(queries) == 1 else f"query[{i}]"
                raise InvalidArgument(f"{name}: must not be empty", field=name, reason="EMPTY_QUERY")
            texts.append(t)
        if store.dimensions != self.embedder.dimensions or store.embedding_model != self.embedder.model:
            raise FailedPrecondition(
                f"vector_store_id: vector store {store.id!r} holds {store.dimensions}-d vectors of "
                f"{store.embedding_model!r} but this service embeds with {self.embedder.model!r} "
                f"({self.embedder.dimensions}-d)", field="vector_store_id", reason="DIMENSION_MISMATCH")
        return await self.embedder.embed(texts)


def _searchable(store: VectorStore) -> None:
    if store.status == "expired":
        raise FailedPrecondition(f"vector_store_id: vector store {store.id!r} has expired", field="vector_store_id",
                                 reason="VECTOR_STORE_EXPIRED")


def _vector_query(store: VectorStore, queries: list[str], vector: np.ndarray) -> np.ndarray:
    """``query_embedding`` checked against the store and normalized, as a (1, dimensions) array."""
    if queries:
        raise InvalidArgument("query: give query text or query_embedding, not both", field="query",
                              reason="QUERY_AND_EMBEDDING")
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.size != store.dimensions:
        raise InvalidArgument(f"query_embedding: {v.size} dimensions but vector store {store.id!r} holds "
                              f"{store.dimensions}-d vectors", field="query_embedding",
                              reason="DIMENSION_MISMATCH")
    norm = float(np.linalg.norm(v))
    if not np.isfinite(v).all() or norm == 0.0:
        raise InvalidArgument("query_embedding: must be finite and not all zero", field="query_embedding",
                              reason="INVALID_EMBEDDING")
    return (v / norm).reshape(1, -1)


def _ranked(per_query: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """(chunk id, similarity) best first over every query's hits, each chunk once with its best score."""
    best: dict[int, float] = {}
    for hits in per_query:
        for cid, sim in hits:
            if sim > best.get(cid, -2.0):
                best[cid] = sim
    return sorted(best.items(), key=lambda kv: -kv[1])


def _hits(ranked: list[tuple[int, float]], rows: dict[int, Any], k: int,
          score_threshold: float | None) -> list[SearchHit]:
    """Search hits, best first, from (chunk id, similarity) pairs and the chunks' rows: chunks deleted since the
    index was updated dropped, scores clamped to [0, 1], at most ``k`` of them at or above the threshold."""
    hits: list[SearchHit] = []
    for cid, sim in ranked:
        row = rows.get(cid)
        if row is None:  # deleted since the index was updated
            continue
        score = min(1.0, max(0.0, sim))
        if score_threshold is not None and score < score_threshold:
            continue
        hits.append(SearchHit(row.file_id, row.filename, score, row.attributes, row.text, cid))
        if len(hits) == k:
            break
    return hits


def build(config: VectorStoreConfig) -> VectorStores:
    """Wire the backend the config names (schema created, index not yet opened: call ``start``)."""
    if config.backend == "pgvector":
        from embedmesh.services.vector_store.index.pgvector import PgVectorIndex

        db = Database.postgres(config.postgres_dsn)
        store = MetadataStore(db, config.dimensions, config.embedding_model)
        store.init_schema()
        # pgvector's own build default (ef_construction 64): its graph build is ~3x slower than hnswlib's.
        index: VectorIndex = PgVectorIndex(store, config.postgres_dsn, m=config.hnsw_m,
                                           ef_search=config.hnsw_ef_search)
    else:
        from embedmesh.services.vector_store.index.embedded import EmbeddedIndex

        os.makedirs(config.data_path, exist_ok=True)
        db = Database.sqlite(os.path.join(config.data_path, "vectorstore.sqlite3"))
        store = MetadataStore(db, config.dimensions, config.embedding_model)
        store.init_schema()
        index = EmbeddedIndex(store, os.path.join(config.data_path, "index"), config.dimensions, m=config.hnsw_m,
                              ef_construction=config.hnsw_ef_construction, ef_search=config.hnsw_ef_search,
                              exact_below=config.exact_search_below, flush_seconds=config.index_flush_seconds)
    embedder = Embedder(config.inference_addr, config.embedding_model, config.dimensions, config.embed_batch_size)
    return VectorStores(store, index, embedder, load_tokenizer(config.tokenizer), config)


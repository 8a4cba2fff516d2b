"""Metadata and chunks on disk: files, vector stores, their files, batches, and chunk rows, in SQLite (embedded
backend) or PostgreSQL (pgvector backend) with the same schema and the same SQL.

The chunk rows are the source of truth for search: a file's chunks are inserted in the same transaction that marks
it ``completed`` (guarded by the file's ingestion token, so a cancelled, deleted or re-added file never completes),
so a crash leaves either no chunks and ``in_progress``, or every chunk and ``completed``. The embedded HNSW index is
derived from these rows and reconciled with them when loaded.

Tenancy: every file, vector store and file batch carries the tenant that created it, and every method a client's
request reaches takes that tenant and matches it in SQL, so another tenant's id behaves exactly like an unknown one
(the same NotFound). A store's files and chunks belong to the store's tenant; files are attached only to stores of
their own tenant. Ids are random (128 bits), never derived from content, so an id tells nothing about the bytes and
cannot be guessed. Rows written before tenancy existed belong to tenant ``default``.

Every method is synchronous and runs on the database thread (``Database.run``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from embedmesh.core.errors import InvalidArgument, NotFound
from embedmesh.services.vector_store.chunking import Chunk
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.objects import (
    Attributes,
    ChunkingSpec,
    ExpiresAfter,
    FileBatch,
    FileCounts,
    FileObject,
    FileStatus,
    Page,
    PageRequest,
    VectorStore,
    VectorStoreFile,
)

__all__ = ["MetadataStore", "PendingFile", "ChunkRow", "new_id", "check_page"]

T = TypeVar("T")

MAX_PAGE = 100


ID_BYTES = 16
"""Random bytes in every id handed to clients (128 bits: unguessable, collision-free in practice)."""


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(ID_BYTES)


def now() -> int:
    return int(time.time())


def check_page(page: PageRequest) -> PageRequest:
    if not 1 <= page.limit <= MAX_PAGE:
        raise InvalidArgument(f"limit must be in [1, {MAX_PAGE}], got {page.limit}", field="limit",
                              reason="LIMIT_OUT_OF_RANGE")
    if page.order not in ("asc", "desc"):
        raise InvalidArgument(f"order must be 'asc' or 'desc', got {page.order!r}", field="order",
                              reason="INVALID_ORDER")
    return page


@dataclass(frozen=True)
class PendingFile:
    """A store file to ingest: what the ingestion task needs, including its token."""

    store_id: str
    file_id: str
    token: str
    chunking: ChunkingSpec


@dataclass(frozen=True)
class ChunkRow:
    id: int
    file_id: str
    text: str
    filename: str
    attributes: Attributes


def _schema(dialect: str, dimensions: int) -> list[str]:
    pk = "INTEGER PRIMARY KEY AUTOINCREMENT" if dialect == "sqlite" else "BIGSERIAL PRIMARY KEY"
    blob = "BLOB" if dialect == "sqlite" else "BYTEA"
    if dialect == "sqlite":
        chunk_cols = "vector BLOB NOT NULL"
    else:
        chunk_cols = f"embedding vector({dimensions}) NOT NULL, attributes JSONB NOT NULL DEFAULT '{{}}'"
    return [
        f"""CREATE TABLE IF NOT EXISTS vs_files (
            seq {pk}, id TEXT NOT NULL UNIQUE, size_bytes BIGINT NOT NULL, created_at BIGINT NOT NULL,
            filename TEXT NOT NULL, purpose TEXT NOT NULL, media_type TEXT NOT NULL, content {blob} NOT NULL,
            tenant TEXT NOT NULL DEFAULT 'default')""",
        f"""CREATE TABLE IF NOT EXISTS vs_stores (
            seq {pk}, id TEXT NOT NULL UNIQUE, created_at BIGINT NOT NULL, name TEXT NOT NULL,
            expires_days INTEGER, last_active_at BIGINT NOT NULL, metadata TEXT NOT NULL,
            embedding_model TEXT NOT NULL, dimensions INTEGER NOT NULL, tenant TEXT NOT NULL DEFAULT 'default')""",
        f"""CREATE TABLE IF NOT EXISTS vs_store_files (
            seq {pk}, store_id TEXT NOT NULL, file_id TEXT NOT NULL, created_at BIGINT NOT NULL,
            status TEXT NOT NULL, error_code TEXT, error_message TEXT, chunk_size INTEGER NOT NULL,
            chunk_overlap INTEGER NOT NULL, attributes TEXT NOT NULL, chunks_done INTEGER NOT NULL DEFAULT 0,
            chunks_total INTEGER NOT NULL DEFAULT 0, usage_bytes BIGINT NOT NULL DEFAULT 0, batch_id TEXT,
            token TEXT NOT NULL, UNIQUE (store_id, file_id))""",
        f"""CREATE TABLE IF NOT EXISTS vs_batches (
            seq {pk}, id TEXT NOT NULL UNIQUE, store_id TEXT NOT NULL, created_at BIGINT NOT NULL,
            cancelled INTEGER NOT NULL DEFAULT 0, tenant TEXT NOT NULL DEFAULT 'default')""",
        f"""CREATE TABLE IF NOT EXISTS vs_chunks (
            id {pk}, store_id TEXT NOT NULL, file_id TEXT NOT NULL, seq INTEGER NOT NULL, text TEXT NOT NULL,
            {chunk_cols})""",
        "CREATE INDEX IF NOT EXISTS vs_chunks_file ON vs_chunks (store_id, file_id)",
        "CREATE INDEX IF NOT EXISTS vs_store_files_batch ON vs_store_files (batch_id)",
    ]


_TENANT_TABLES = ("vs_files", "vs_stores", "vs_batches")
"""Tables whose rows carry their tenant (``tenant`` column, added to databases made before it existed)."""

_TENANT_INDEXES = [
    "CREATE INDEX IF NOT EXISTS vs_files_tenant ON vs_files (tenant, seq)",
    "CREATE INDEX IF NOT EXISTS vs_stores_tenant ON vs_stores (tenant, seq)",
]


def _status_counts(rows: Sequence[tuple[Any, ...]]) -> FileCounts:
    c = {s: int(n) for s, n in rows}
    return FileCounts(c.get("in_progress", 0), c.get("completed", 0), c.get("failed", 0), c.get("cancelled", 0))


class MetadataStore:
    """Files, stores, store files, batches and chunk rows. ``dimensions`` fixes the pgvector column size."""

    def __init__(self, db: Database, dimensions: int, embedding_model: str) -> None:
        self.db = db
        self.dimensions = dimensions
        self.embedding_model = embedding_model

    # --- schema -------------------------------------------------------------------------------------------------
    def init_schema(self) -> None:
        if self.db.dialect == "postgres":
            self.db.execute("CREATE EXTENSION IF NOT EXISTS vector")
            row = self.db.one("SELECT atttypmod FROM pg_attribute WHERE attrelid = to_regclass('vs_chunks') "
                              "AND attname = 'embedding'")
            if row is not None and int(row[0]) != self.dimensions:
                raise RuntimeError(f"vs_chunks holds {row[0]}-d vectors but the service is configured for "
                                   f"{self.dimensions}; use another database or the matching --dimensions")
        with self.db.transaction():
            for stmt in _schema(self.db.dialect, self.dimensions):
                self.db.execute(stmt)
            self._add_tenant_columns()
            for stmt in _TENANT_INDEXES:
                self.db.execute(stmt)

    def _add_tenant_columns(self) -> None:
        """Migration: tables created before tenancy get ``tenant`` with 'default' for their existing rows."""
        for table in _TENANT_TABLES:
            if self.db.dialect == "postgres":
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS tenant TEXT NOT NULL "
                                f"DEFAULT 'default'")
            elif "tenant" not in {r[1] for r in self.db.query(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'")

    # --- paging -------------------------------------------------------------------------------------------------
    def _page(self, table: str, where: str, params: Sequence[Any], page: PageRequest, cursor_col: str,
              columns: str, build: Callable[[tuple[Any, ...]], T]) -> Page[T]:
        check_page(page)
        asc = page.order == "asc"
        conds, p = [where], list(params)
        for name, cursor in (("after", page.after), ("before", page.before)):
            if not cursor:
                continue
            row = self.db.one(f"SELECT seq FROM {table} WHERE {where} AND {cursor_col} = ?", [*params, cursor])
            if row is None:
                raise InvalidArgument(f"{name}: no item {cursor!r} in this list", field=name, reason="INVALID_CURSOR")
            forward = (name == "after") == asc
            conds.append("seq > ?" if forward else "seq < ?")
            p.append(row[0])
        # `before` alone pages backwards: the items nearest the cursor, then shown in the requested order.
        backwards = bool(page.before) and not page.after
        direction = "ASC" if asc != backwards else "DESC"
        rows = self.db.query(f"SELECT {columns} FROM {table} WHERE {' AND '.join(conds)} ORDER BY seq {direction} "
                             f"LIMIT ?", [*p, page.limit + 1])
        has_more = len(rows) > page.limit
        rows = rows[:page.limit]
        if backwards:
            rows.reverse()
        return Page([build(r) for r in rows], has_more)

    # --- files --------------------------------------------------------------------------------------------------
    _FILE_COLS = "id, size_bytes, created_at, filename, purpose, media_type"

    @staticmethod
    def _file(r: tuple[Any, ...]) -> FileObject:
        return FileObject(r[0], int(r[1]), int(r[2]), r[3], r[4], r[5])

    def create_file(self, tenant: str, filename: str, purpose: str, media_type: str, content: bytes) -> FileObject:
        f = FileObject(new_id("file-"), len(content), now(), filename, purpose, media_type)
        self.db.execute("INSERT INTO vs_files (id, size_bytes, created_at, filename, purpose, media_type, content, "
                        "tenant) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [f.id, f.size_bytes, f.created_at, filename, purpose, media_type, content, tenant])
        return f

    @staticmethod
    def _no_file(file_id: str, field: str) -> NotFound:
        return NotFound(f"{field}: no file {file_id!r}", field=field, reason="FILE_NOT_FOUND")

    def get_file(self, tenant: str, file_id: str, field: str = "file_id") -> FileObject:
        row = self.db.one(f"SELECT {self._FILE_COLS} FROM vs_files WHERE id = ? AND tenant = ?", [file_id, tenant])
        if row is None:
            raise self._no_file(file_id, field)
        return self._file(row)

    def file_content(self, tenant: str, file_id: str) -> bytes:
        row = self.db.one("SELECT content FROM vs_files WHERE id = ? AND tenant = ?", [file_id, tenant])
        if row is None:
            raise self._no_file(file_id, "file_id")
        return bytes(row[0])

    def ingest_source(self, file_id: str) -> tuple[str, bytes]:
        """(media type, content) of a file for ingestion. Unscoped: ingestion runs in the background (and after a
        restart) for a store file whose file and store were checked to share a tenant when it was added."""
        row = self.db.one("SELECT media_type, content FROM vs_files WHERE id = ?", [file_id])
        if row is None:
            raise self._no_file(file_id, "file_id")
        return row[0], bytes(row[1])

    def list_files(self, tenant: str, purpose: str, page: PageRequest) -> Page[FileObject]:
        where, params = "tenant = ?", [tenant]
        if purpose:
            where += " AND purpose = ?"
            params.append(purpose)
        return self._page("vs_files", where, params, page, "id", self._FILE_COLS, self._file)

    def delete_file(self, tenant: str, file_id: str) -> list[tuple[str, list[int]]]:
        """Delete a file and its membership in every store; returns (store_id, removed chunk ids) per store."""
        self.get_file(tenant, file_id)
        with self.db.transaction():
            stores = [r[0] for r in self.db.query("SELECT store_id FROM vs_store_files WHERE file_id = ?", [file_id])]
            removed = [(s, self._drop_chunks(s, file_id)) for s in stores]
            self.db.execute("DELETE FROM vs_store_files WHERE file_id = ?", [file_id])
            self.db.execute("DELETE FROM vs_files WHERE id = ?", [file_id])
        return removed

    # --- stores -------------------------------------------------------------------------------------------------
    _STORE_COLS = "id, created_at, name, expires_days, last_active_at, metadata, embedding_model, dimensions"

    def _store(self, r: tuple[Any, ...]) -> VectorStore:
        sid = r[0]
        counts = _status_counts(self.db.query(
            "SELECT status, COUNT(*) FROM vs_store_files WHERE store_id = ? GROUP BY status", [sid]))
        usage = self.db.one("SELECT COALESCE(SUM(usage_bytes), 0) FROM vs_store_files WHERE store_id = ?", [sid])
        days = r[3]
        last_active = int(r[4])
        expires_at = last_active + int(days) * 86400 if days else None
        if expires_at is not None and expires_at <= now():
            status = "expired"
        else:
            status = "in_progress" if counts.in_progress else "completed"
        return VectorStore(sid, int(r[1]), r[2], int(usage[0] if usage else 0), counts, status,  # type: ignore[arg-type]
                           ExpiresAfter(int(days)) if days else None, expires_at, last_active, json.loads(r[5]),
                           r[6], int(r[7]))

    def create_store(self, tenant: str, name: str, expires: ExpiresAfter | None, metadata: dict[str, str]) -> str:
        sid = new_id("vs_")
        t = now()
        self.db.execute(f"INSERT INTO vs_stores ({self._STORE_COLS}, tenant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [sid, t, name, expires.days if expires else None, t, json.dumps(metadata),
                         self.embedding_model, self.dimensions, tenant])
        return sid

    def get_store(self, tenant: str, store_id: str, field: str = "vector_store_id") -> VectorStore:
        row = self.db.one(f"SELECT {self._STORE_COLS} FROM vs_stores WHERE id = ? AND tenant = ?",
                          [store_id, tenant])
        if row is None:
            raise NotFound(f"{field}: no vector store {store_id!r}", field=field, reason="VECTOR_STORE_NOT_FOUND")
        return self._store(row)

    def list_stores(self, tenant: str, page: PageRequest) -> Page[VectorStore]:
        return self._page("vs_stores", "tenant = ?", [tenant], page, "id", self._STORE_COLS, self._store)

    def update_store(self, tenant: str, store_id: str, name: str | None, expires: ExpiresAfter | None,
                     clear_expires: bool, metadata: dict[str, str] | None) -> VectorStore:
        self.get_store(tenant, store_id)
        sets, params = ["last_active_at = ?"], [now()]
        if name is not None:
            sets.append("name = ?")
            params.append(name)  # type: ignore[arg-type]
        if clear_expires:
            sets.append("expires_days = NULL")
        elif expires is not None:
            sets.append("expires_days = ?")
            params.append(expires.days)
        if metadata is not None:
            sets.append("metadata = ?")
            params.append(json.dumps(metadata))  # type: ignore[arg-type]
        self.db.execute(f"UPDATE vs_stores SET {', '.join(sets)} WHERE id = ? AND tenant = ?",
                        [*params, store_id, tenant])
        return self.get_store(tenant, store_id)

    def touch_store(self, store_id: str, resolution_seconds: int = 0) -> None:
        """Record activity (expiry counts from it). Searches pass a resolution so they rarely write."""
        t = now()
        self.db.execute("UPDATE vs_stores SET last_active_at = ? WHERE id = ? AND last_active_at <= ?",
                        [t, store_id, t - resolution_seconds])

    def delete_store(self, tenant: str, store_id: str) -> None:
        self.get_store(tenant, store_id)
        with self.db.transaction():
            self.db.execute("DELETE FROM vs_chunks WHERE store_id = ?", [store_id])
            self.db.execute("DELETE FROM vs_store_files WHERE store_id = ?", [store_id])
            self.db.execute("DELETE FROM vs_batches WHERE store_id = ?", [store_id])
            self.db.execute("DELETE FROM vs_stores WHERE id = ?", [store_id])

    # --- files in a store ---------------------------------------------------------------------------------------
    # Reads and changes of a store's files take a store id the caller has already found with ``get_store`` for the
    # requesting tenant (VectorStores does so first in every operation); ``add_store_file`` checks both ids itself.
    _SF_COLS = ("file_id, created_at, store_id, usage_bytes, status, error_code, error_message, chunk_size, "
                "chunk_overlap, attributes, chunks_done, chunks_total")

    @staticmethod
    def _sf(r: tuple[Any, ...]) -> VectorStoreFile:
        err = (r[5], r[6]) if r[5] else None
        return VectorStoreFile(r[0], int(r[1]), r[2], int(r[3]), r[4], err, ChunkingSpec(int(r[7]), int(r[8])),
                               json.loads(r[9]), int(r[10]), int(r[11]))

    def add_store_file(self, tenant: str, store_id: str, file_id: str, chunking: ChunkingSpec, attributes: Attributes,
                       batch_id: str | None = None) -> tuple[VectorStoreFile, PendingFile, list[int]]:
        """Insert (or reset, when already there) a store file as in_progress with a fresh token; returns it, what
        to ingest, and chunk ids of a previous ingestion that were removed. The store and the file must both be
        ``tenant``'s (NotFound naming the missing one otherwise), so a store never holds another tenant's file."""
        token = secrets.token_hex(8)
        with self.db.transaction():
            if self.db.one("SELECT 1 FROM vs_stores WHERE id = ? AND tenant = ?", [store_id, tenant]) is None:
                raise NotFound(f"vector_store_id: no vector store {store_id!r}", field="vector_store_id",
                               reason="VECTOR_STORE_NOT_FOUND")
            if self.db.one("SELECT 1 FROM vs_files WHERE id = ? AND tenant = ?", [file_id, tenant]) is None:
                raise self._no_file(file_id, "file_id")
            removed = self._drop_chunks(store_id, file_id)
            self.db.execute("DELETE FROM vs_store_files WHERE store_id = ? AND file_id = ?", [store_id, file_id])
            self.db.execute(
                "INSERT INTO vs_store_files (store_id, file_id, created_at, status, chunk_size, chunk_overlap, "
                "attributes, batch_id, token) VALUES (?, ?, ?, 'in_progress', ?, ?, ?, ?, ?)",
                [store_id, file_id, now(), chunking.max_chunk_size_tokens, chunking.chunk_overlap_tokens,
                 json.dumps(attributes), batch_id, token])
            self.touch_store(store_id)
        return self.get_store_file(store_id, file_id), PendingFile(store_id, file_id, token, chunking), removed

    def get_store_file(self, store_id: str, file_id: str) -> VectorStoreFile:
        row = self.db.one(f"SELECT {self._SF_COLS} FROM vs_store_files WHERE store_id = ? AND file_id = ?",
                          [store_id, file_id])
        if row is None:
            raise NotFound(f"file_id: file {file_id!r} is not in vector store {store_id!r}", field="file_id",
                           reason="FILE_NOT_FOUND")
        return self._sf(row)

    def list_store_files(self, store_id: str, status: FileStatus | None, page: PageRequest,
                         batch_id: str | None = None) -> Page[VectorStoreFile]:
        where, params = "store_id = ?", [store_id]
        if status:
            where += " AND status = ?"
            params.append(status)
        if batch_id:
            where += " AND batch_id = ?"
            params.append(batch_id)
        return self._page("vs_store_files", where, params, page, "file_id", self._SF_COLS, self._sf)

    def update_attributes(self, store_id: str, file_id: str, attributes: Attributes) -> VectorStoreFile:
        self.get_store_file(store_id, file_id)
        with self.db.transaction():
            self.db.execute("UPDATE vs_store_files SET attributes = ? WHERE store_id = ? AND file_id = ?",
                            [json.dumps(attributes), store_id, file_id])
            if self.db.dialect == "postgres":
                self.db.execute("UPDATE vs_chunks SET attributes = ?::jsonb WHERE store_id = ? AND file_id = ?",
                                [json.dumps(attributes), store_id, file_id])
            self.touch_store(store_id)
        return self.get_store_file(store_id, file_id)

    def delete_store_file(self, store_id: str, file_id: str) -> list[int]:
        self.get_store_file(store_id, file_id)
        with self.db.transaction():
            removed = self._drop_chunks(store_id, file_id)
            self.db.execute("DELETE FROM vs_store_files WHERE store_id = ? AND file_id = ?", [store_id, file_id])
        return removed

    def _drop_chunks(self, store_id: str, file_id: str) -> list[int]:
        ids = [int(r[0]) for r in self.db.query("SELECT id FROM vs_chunks WHERE store_id = ? AND file_id = ?",
                                                [store_id, file_id])]
        if ids:
            self.db.execute("DELETE FROM vs_chunks WHERE store_id = ? AND file_id = ?", [store_id, file_id])
        return ids

    # --- ingestion ----------------------------------------------------------------------------------------------
    def pending(self) -> list[PendingFile]:
        """Every store file still in progress (after a crash: the ones to re-queue), oldest first."""
        rows = self.db.query("SELECT store_id, file_id, token, chunk_size, chunk_overlap FROM vs_store_files "
                             "WHERE status = 'in_progress' ORDER BY seq")
        return [PendingFile(r[0], r[1], r[2], ChunkingSpec(int(r[3]), int(r[4]))) for r in rows]

    def is_current(self, p: PendingFile) -> bool:
        return self.db.one("SELECT 1 FROM vs_store_files WHERE store_id = ? AND file_id = ? AND token = ? AND "
                           "status = 'in_progress'", [p.store_id, p.file_id, p.token]) is not None

    def set_progress(self, p: PendingFile, done: int, total: int) -> None:
        self.db.execute("UPDATE vs_store_files SET chunks_done = ?, chunks_total = ? WHERE store_id = ? AND "
                        "file_id = ? AND token = ?", [done, total, p.store_id, p.file_id, p.token])

    def fail(self, p: PendingFile, code: str, message: str) -> bool:
        n = self.db.execute("UPDATE vs_store_files SET status = 'failed', error_code = ?, error_message = ? "
                            "WHERE store_id = ? AND file_id = ? AND token = ? AND status = 'in_progress'",
                            [code, message[:1000], p.store_id, p.file_id, p.token])
        return n > 0

    def complete(self, p: PendingFile, chunks: list[Chunk], vectors: np.ndarray) -> list[int] | None:
        """Insert the chunks and mark the file completed, atomically. None (and nothing written) when the file was
        cancelled, deleted or re-added meanwhile. Returns the new chunk ids in chunk order."""
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        usage = sum(len(c.text.encode()) for c in chunks) + vectors.nbytes
        with self.db.transaction():
            row = self.db.one("SELECT attributes FROM vs_store_files WHERE store_id = ? AND file_id = ? AND "
                              "token = ? AND status = 'in_progress'", [p.store_id, p.file_id, p.token])
            if row is None:
                return None
            if self.db.dialect == "sqlite":
                self.db.executemany(
                    "INSERT INTO vs_chunks (store_id, file_id, seq, text, vector) VALUES (?, ?, ?, ?, ?)",
                    [(p.store_id, p.file_id, c.seq, c.text, vectors[i].tobytes()) for i, c in enumerate(chunks)])
            else:
                self.db.executemany(
                    "INSERT INTO vs_chunks (store_id, file_id, seq, text, embedding, attributes) "
                    "VALUES (?, ?, ?, ?, ?::vector, ?::jsonb)",
                    [(p.store_id, p.file_id, c.seq, c.text, vector_literal(vectors[i]), row[0])
                     for i, c in enumerate(chunks)])
            self.db.execute("UPDATE vs_store_files SET status = 'completed', chunks_done = ?, chunks_total = ?, "
                            "usage_bytes = ? WHERE store_id = ? AND file_id = ?",
                            [len(chunks), len(chunks), usage, p.store_id, p.file_id])
            ids = [int(r[0]) for r in self.db.query(
                "SELECT id FROM vs_chunks WHERE store_id = ? AND file_id = ? ORDER BY seq", [p.store_id, p.file_id])]
        return ids

    # --- batches ------------------------------------------------------------------------------------------------
    def create_batch(self, tenant: str, store_id: str) -> str:
        bid = new_id("vsfb_")
        self.db.execute("INSERT INTO vs_batches (id, store_id, created_at, tenant) VALUES (?, ?, ?, ?)",
                        [bid, store_id, now(), tenant])
        return bid

    def get_batch(self, tenant: str, store_id: str, batch_id: str) -> FileBatch:
        row = self.db.one("SELECT id, created_at, store_id, cancelled FROM vs_batches WHERE id = ? AND store_id = ? "
                          "AND tenant = ?", [batch_id, store_id, tenant])
        if row is None:
            raise NotFound(f"batch_id: no file batch {batch_id!r} in vector store {store_id!r}", field="batch_id",
                           reason="BATCH_NOT_FOUND")
        counts = _status_counts(self.db.query(
            "SELECT status, COUNT(*) FROM vs_store_files WHERE batch_id = ? GROUP BY status", [batch_id]))
        status: FileStatus
        if counts.in_progress:
            status = "in_progress"
        elif row[3]:
            status = "cancelled"
        elif counts.failed:
            status = "failed"
        else:
            status = "completed"
        return FileBatch(row[0], int(row[1]), row[2], status, counts)

    def cancel_batch(self, tenant: str, store_id: str, batch_id: str) -> list[str]:
        """Mark the batch cancelled and its in-progress files cancelled; returns those file ids."""
        self.get_batch(tenant, store_id, batch_id)
        with self.db.transaction():
            ids = [r[0] for r in self.db.query("SELECT file_id FROM vs_store_files WHERE batch_id = ? AND "
                                               "status = 'in_progress'", [batch_id])]
            self.db.execute("UPDATE vs_store_files SET status = 'cancelled' WHERE batch_id = ? AND "
                            "status = 'in_progress'", [batch_id])
            self.db.execute("UPDATE vs_batches SET cancelled = 1 WHERE id = ?", [batch_id])
        return ids

    # --- search support -----------------------------------------------------------------------------------------
    def completed_files(self, store_id: str) -> list[tuple[str, Attributes, int]]:
        """(file_id, attributes, chunk count) of the store's searchable files."""
        return [(r[0], json.loads(r[1]), int(r[2])) for r in self.db.query(
            "SELECT file_id, attributes, chunks_total FROM vs_store_files WHERE store_id = ? AND "
            "status = 'completed'", [store_id])]

    def chunk_rows(self, store_id: str, ids: Sequence[int]) -> dict[int, ChunkRow]:
        """Text, file name and attributes of chunks (of completed files only) by id."""
        out: dict[int, ChunkRow] = {}
        for i in range(0, len(ids), 500):
            part = list(ids[i:i + 500])
            marks = ", ".join("?" * len(part))
            # Look chunks up by primary key only: a `c.store_id = ?` term lets SQLite pick the (store_id, file_id)
            # index and scan the whole store (18 ms at 100k chunks instead of 0.1 ms).
            rows = self.db.query(
                "SELECT c.id, c.file_id, c.text, f.filename, sf.attributes, c.store_id FROM vs_chunks c "
                "JOIN vs_store_files sf ON sf.store_id = c.store_id AND sf.file_id = c.file_id "
                "JOIN vs_files f ON f.id = c.file_id "
                f"WHERE c.id IN ({marks}) AND sf.status = 'completed'", part)
            for r in rows:
                if r[5] == store_id:
                    out[int(r[0])] = ChunkRow(int(r[0]), r[1], r[2], r[3], json.loads(r[4]))
        return out

    def chunk_ids(self, store_id: str) -> list[tuple[int, str]]:
        """(chunk id, file id) of every chunk of a store (embedded index reconciliation)."""
        return [(int(r[0]), r[1]) for r in self.db.query("SELECT id, file_id FROM vs_chunks WHERE store_id = ?",
                                                         [store_id])]

    def chunk_vectors(self, ids: Sequence[int]) -> np.ndarray:
        """Vectors of chunks, in the order of ``ids`` (SQLite only: the embedded backend keeps them as blobs)."""
        out = np.zeros((len(ids), self.dimensions), dtype=np.float32)
        pos = {cid: i for i, cid in enumerate(ids)}
        for i in range(0, len(ids), 500):
            part = list(ids[i:i + 500])
            marks = ", ".join("?" * len(part))
            for cid, blob in self.db.query(f"SELECT id, vector FROM vs_chunks WHERE id IN ({marks})", part):
                out[pos[int(cid)]] = np.frombuffer(blob, dtype="<f4")
        return out

    def store_ids(self) -> list[str]:
        return [r[0] for r in self.db.query("SELECT id FROM vs_stores")]


def vector_literal(v: np.ndarray) -> str:
    """pgvector's text form: ``[x1,x2,...]`` with full float32 precision."""
    return "[" + ",".join(repr(float(x)) for x in v) + "]"

"""Where the Batch API keeps its state: batch files, batches and every line's result, in a real database — SQLite
(a file, the default) or PostgreSQL (``--batch-db postgresql://...``), through the vector store's ``Database``
(one connection driven from one thread; psycopg for PostgreSQL).

    batch_files   id, tenant, purpose (batch | batch_output), filename, bytes, created_at, content
    batches       the batch object's fields, request counts, the sealed Authorization it runs under, and the lease
                  of the runner that works on it (lease_owner, lease_until, served_at)
    batch_lines   batch_id, idx (file order), ord (run order), custom_id, url, body, done, ok, result

Why here and not in the vector store's files: the vector store is optional (its routes answer 501 without it),
takes text-like files for search, and cannot record a line's result in the same transaction as the batch's
counts. Here a finished line is one transaction (its result, ``done``, the count), guarded by ``done = 0``: a line
is counted once, and after a restart only lines not yet done run again.

Every statement that reads or changes a client's object names the tenant, so another tenant's id reads exactly like
an unknown one.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from embedmesh.services.vector_store.db import Database

__all__ = ["BatchStore", "default_path", "ACTIVE", "new_id"]

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses a runner still has work for."""

_TABLES = (
    """CREATE TABLE IF NOT EXISTS batch_files (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
        bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, created_ns BIGINT NOT NULL, content {blob} NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT, errors TEXT,
        created_at BIGINT NOT NULL, created_ns BIGINT NOT NULL, in_progress_at BIGINT, finalizing_at BIGINT,
        completed_at BIGINT,
        failed_at BIGINT, cancelling_at BIGINT, cancelled_at BIGINT, expires_at BIGINT NOT NULL, expired_at BIGINT,
        total BIGINT NOT NULL, completed BIGINT NOT NULL DEFAULT 0, failed BIGINT NOT NULL DEFAULT 0,
        output_file_id TEXT, error_file_id TEXT, auth TEXT NOT NULL,
        lease_owner TEXT NOT NULL DEFAULT '', lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
        served_at DOUBLE PRECISION NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS batch_lines (
        batch_id TEXT NOT NULL, idx BIGINT NOT NULL, ord BIGINT NOT NULL, custom_id TEXT NOT NULL,
        url TEXT NOT NULL, body {blob} NOT NULL, done SMALLINT NOT NULL DEFAULT 0, ok SMALLINT NOT NULL DEFAULT 0,
        result {blob}, PRIMARY KEY (batch_id, idx))""",
    "CREATE INDEX IF NOT EXISTS batch_lines_todo ON batch_lines (batch_id, done, ord)",
    "CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_ns)",
    "CREATE INDEX IF NOT EXISTS batch_files_tenant ON batch_files (tenant, purpose, created_ns)",
)
_BATCH_COLUMNS = ("id, endpoint, input_file_id, completion_window, status, metadata, errors, created_at, "
                  "in_progress_at, finalizing_at, completed_at, failed_at, cancelling_at, cancelled_at, expires_at, "
                  "total, completed, failed, output_file_id, error_file_id, expired_at")
_FILE_COLUMNS = "id, purpose, filename, bytes, created_at"


def default_path() -> str:
    """``$EMBEDMESH_CACHE/batches.sqlite3`` (``~/.cache/embedmesh`` when unset)."""
    root = os.environ.get("EMBEDMESH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "embedmesh")
    return os.path.join(root, "batches.sqlite3")


def new_id(prefix: str) -> str:
    """A random id (never a content hash: ids given to clients say nothing about what they hold)."""
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class Work:
    """A line the runner still has to run."""

    idx: int
    custom_id: str
    url: str
    body: bytes


def _file_json(row: Sequence[Any]) -> dict[str, Any]:
    return {"id": row[0], "object": "file", "bytes": int(row[3]), "created_at": int(row[4]), "filename": row[2],
            "purpose": row[1], "status": "processed", "status_details": None, "expires_at": None}


def _batch_json(row: Sequence[Any]) -> dict[str, Any]:
    (bid, endpoint, input_file_id, window, status, metadata, errors, created, in_progress, finalizing, completed_at,
     failed_at, cancelling, cancelled, expires, total, completed, failed, output_id, error_id, expired_at) = row
    return {"id": bid, "object": "batch", "endpoint": endpoint,
            "errors": orjson.loads(errors) if errors else None, "input_file_id": input_file_id,
            "completion_window": window, "status": status, "output_file_id": output_id, "error_file_id": error_id,
            "created_at": created, "in_progress_at": in_progress, "expires_at": expires,
            "finalizing_at": finalizing, "completed_at": completed_at, "failed_at": failed_at, "expired_at": expired_at,
            "cancelling_at": cancelling, "cancelled_at": cancelled,
            "request_counts": {"total": int(total), "completed": int(completed), "failed": int(failed)},
            "metadata": orjson.loads(metadata) if metadata else None}


class BatchStore:
    """``target``: a PostgreSQL URL or libpq DSN (``host=... dbname=...``), a SQLite file path, or "" for
    ``default_path()``. Every method is async and runs its statements on the database's own thread."""

    def __init__(self, target: str) -> None:
        self.postgres = target.startswith(("postgresql://", "postgres://")) or "dbname=" in target
        self.target = target or default_path()
        self._db: Database | None = None
        self._opening = asyncio.Lock()

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._db is None:
            async with self._opening:  # opened once, off the event loop (a PostgreSQL connect can take a while)
                if self._db is None:
                    self._db = await asyncio.to_thread(self._open)
        return await self._db.run(fn, *args)

    def _open(self) -> Database:
        if self.postgres:
            db = Database.postgres(self.target)
        else:
            if self.target != ":memory:":
                Path(self.target).parent.mkdir(parents=True, exist_ok=True)
            db = Database.sqlite(self.target)
        blob = "BYTEA" if self.postgres else "BLOB"
        for ddl in _TABLES:  # on the opening thread, before the database thread runs anything
            db.execute(ddl.replace("{blob}", blob))
        if self.postgres:  # a database made before batches expired
            db.execute("ALTER TABLE batches ADD COLUMN IF NOT EXISTS expired_at BIGINT")
        elif "expired_at" not in {row[1] for row in db.query("PRAGMA table_info(batches)")}:
            db.execute("ALTER TABLE batches ADD COLUMN expired_at BIGINT")
        return db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # --- files ---------------------------------------------------------------------------------------------------
    async def add_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        fid, now = new_id("file-"), int(time.time())

        def go(db: Database) -> None:
            db.execute("INSERT INTO batch_files (id, tenant, purpose, filename, bytes, created_at, created_ns, "
                       "content) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (fid, tenant, purpose, filename, len(content), now, time.time_ns(), content))

        await self._run(lambda: go(self._db))  # type: ignore[arg-type]
        return _file_json((fid, purpose, filename, len(content), now))

    async def file(self, tenant: str, fid: str) -> dict[str, Any] | None:
        row = await self._run(lambda: self._db.one(  # type: ignore[union-attr]
            f"SELECT {_FILE_COLUMNS} FROM batch_files WHERE id = ? AND tenant = ?", (fid, tenant)))
        return _file_json(row) if row else None

    async def file_content(self, tenant: str, fid: str) -> bytes | None:
        row = await self._run(lambda: self._db.one(  # type: ignore[union-attr]
            "SELECT content FROM batch_files WHERE id = ? AND tenant = ?", (fid, tenant)))
        return bytes(row[0]) if row else None

    async def delete_file(self, tenant: str, fid: str) -> bool:
        n = await self._run(lambda: self._db.execute(  # type: ignore[union-attr]
            "DELETE FROM batch_files WHERE id = ? AND tenant = ?", (fid, tenant)))
        return bool(n)

    async def list_files(self, tenant: str, purposes: Sequence[str], after: str, limit: int,
                         ascending: bool) -> tuple[list[dict[str, Any]], bool]:
        """A page of the tenant's files of any of ``purposes`` (at least one)."""
        marks = ", ".join("?" * len(purposes))
        rows = await self._page("batch_files", _FILE_COLUMNS, f"tenant = ? AND purpose IN ({marks})",
                                (tenant, *purposes), after, limit, ascending)
        return [_file_json(r) for r in rows[:limit]], len(rows) > limit

    async def _page(self, table: str, columns: str, where: str, params: tuple[Any, ...], after: str, limit: int,
                    ascending: bool) -> list[tuple[Any, ...]]:
        """``limit + 1`` rows after the cursor ``after`` (an id of this tenant; unknown = from the start), in
        creation order (``created_ns``, then id)."""
        op, order = (">", "ASC") if ascending else ("<", "DESC")

        def go(db: Database) -> list[tuple[Any, ...]]:
            cursor = db.one(f"SELECT created_ns, id FROM {table} WHERE id = ? AND {where}", (after, *params)) \
                if after else None
            extra, args = "", params
            if cursor is not None:
                extra = f" AND (created_ns {op} ? OR (created_ns = ? AND id {op} ?))"
                args = (*params, cursor[0], cursor[0], cursor[1])
            return db.query(f"SELECT {columns} FROM {table} WHERE {where}{extra} ORDER BY created_ns {order}, "
                            f"id {order} LIMIT ?", (*args, limit + 1))

        return await self._run(lambda: go(self._db))  # type: ignore[arg-type]

    # --- batches -------------------------------------------------------------------------------------------------
    async def create_batch(self, tenant: str, endpoint: str, input_file_id: str, window: str,
                           metadata: dict[str, str] | None, auth: str,
                           lines: Sequence[tuple[str, str, bytes, int]],
                           refused: dict[int, bytes], owner: str = "", lease_s: float = 0.0) -> dict[str, Any]:
        """A new batch (``validating``) with its lines: (custom_id, url, body, ord) in file order; ``refused``
        holds lines that fail at once (index -> their error-file line), recorded done and failed. Leased to
        ``owner`` (the creating gateway's runner) for ``lease_s``: another gateway takes it only if that one stops
        renewing."""
        bid, now = new_id("batch_"), int(time.time())
        meta = orjson.dumps(metadata).decode() if metadata is not None else None

        def go(db: Database) -> None:
            with db.transaction():
                db.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, "
                           "metadata, created_at, created_ns, expires_at, total, failed, auth, lease_owner, "
                           "lease_until) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (bid, tenant, endpoint, input_file_id, window, meta, now, time.time_ns(),
                            now + 24 * 3600, len(lines), len(refused), auth, owner, time.time() + lease_s))
                db.executemany("INSERT INTO batch_lines (batch_id, idx, ord, custom_id, url, body, done, ok, "
                               "result) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
                               [(bid, i, o, cid, url, body, int(i in refused), refused.get(i))
                                for i, (cid, url, body, o) in enumerate(lines)])

        await self._run(lambda: go(self._db))  # type: ignore[arg-type]
        got = await self.batch(tenant, bid)
        assert got is not None
        return got

    async def batch(self, tenant: str, bid: str) -> dict[str, Any] | None:
        row = await self._run(lambda: self._db.one(  # type: ignore[union-attr]
            f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ? AND tenant = ?", (bid, tenant)))
        return _batch_json(row) if row else None

    async def list_batches(self, tenant: str, after: str, limit: int,
                           ascending: bool) -> tuple[list[dict[str, Any]], bool]:
        rows = await self._page("batches", _BATCH_COLUMNS, "tenant = ?", (tenant,), after, limit, ascending)
        return [_batch_json(r) for r in rows[:limit]], len(rows) > limit

    async def cancel(self, tenant: str, bid: str) -> dict[str, Any] | None:
        """Mark an unfinished batch ``cancelling`` (the runner stops it and writes what is done); a finished one
        is left as it is."""
        now = int(time.time())
        await self._run(lambda: self._db.execute(  # type: ignore[union-attr]
            "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND tenant = ? AND status IN "
            "('validating', 'in_progress')", (now, bid, tenant)))
        return await self.batch(tenant, bid)

    # --- the runner's side ---------------------------------------------------------------------------------------
    async def claim(self, owner: str, lease_s: float) -> tuple[str, str, str, str, int] | None:
        """The active batch served longest ago whose lease is free or already ``owner``'s, leased to ``owner``:
        (id, tenant, status, sealed auth, expires_at); None when there is none."""

        def go(db: Database) -> tuple[str, str, str, str, int] | None:
            now = time.time()
            for bid, tenant, status, auth, expires in db.query(
                    "SELECT id, tenant, status, auth, expires_at FROM batches WHERE status IN (?, ?, ?, ?) AND "
                    "(lease_owner = ? OR lease_until < ?) ORDER BY served_at, created_ns LIMIT 8",
                    (*ACTIVE, owner, now)):
                if db.execute("UPDATE batches SET lease_owner = ?, lease_until = ?, served_at = ? WHERE id = ? AND "
                              "(lease_owner = ? OR lease_until < ?)",
                              (owner, now + lease_s, now, bid, owner, now)):
                    return bid, tenant, status, auth, int(expires)
            return None

        return await self._run(lambda: go(self._db))  # type: ignore[arg-type]

    async def renew(self, bid: str, owner: str, lease_s: float) -> str | None:
        """Extend ``owner``'s lease; the batch's status, or None when the lease is no longer ``owner``'s."""

        def go(db: Database) -> str | None:
            if not db.execute("UPDATE batches SET lease_until = ? WHERE id = ? AND lease_owner = ?",
                              (time.time() + lease_s, bid, owner)):
                return None
            row = db.one("SELECT status FROM batches WHERE id = ?", (bid,))
            return str(row[0]) if row else None

        return await self._run(lambda: go(self._db))  # type: ignore[arg-type]

    async def release(self, bid: str, owner: str) -> None:
        await self._run(lambda: self._db.execute(  # type: ignore[union-attr]
            "UPDATE batches SET lease_until = 0 WHERE id = ? AND lease_owner = ?", (bid, owner)))

    async def start(self, bid: str) -> None:
        await self._run(lambda: self._db.execute(  # type: ignore[union-attr]
            "UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? AND status = 'validating'",
            (int(time.time()), bid)))

    async def todo(self, bid: str, limit: int) -> list[Work]:
        """Up to ``limit`` lines not done yet, in run order."""
        rows = await self._run(lambda: self._db.query(  # type: ignore[union-attr]
            "SELECT idx, custom_id, url, body FROM batch_lines WHERE batch_id = ? AND done = 0 ORDER BY ord "
            "LIMIT ?", (bid, limit)))
        return [Work(int(i), c, u, bytes(b)) for i, c, u, b in rows]

    async def finish_line(self, bid: str, idx: int, ok: bool, result: bytes) -> bool:
        """Record a line's result and count it, once: False when it was done already."""

        def go(db: Database) -> bool:
            with db.transaction():
                if not db.execute("UPDATE batch_lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND "
                                  "idx = ? AND done = 0", (int(ok), result, bid, idx)):
                    return False
                column = "completed" if ok else "failed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (bid,))
                return True

        return await self._run(lambda: go(self._db))  # type: ignore[arg-type]

    async def finalize(self, bid: str, cancelled: bool = False, expired: bool = False) -> None:
        """Write the output and error files from the recorded lines (file order) and end the batch: completed,
        cancelled, or expired (its completion window ended first: each line not done yet goes to the error file as
        OpenAI writes an expired request, ``batch_expired``, and counts as failed). One transaction: run twice (a
        restart in between), it writes them once."""

        def go(db: Database) -> None:
            now = int(time.time())
            with db.transaction():
                row = db.one("SELECT tenant, status FROM batches WHERE id = ?", (bid,))
                if row is None or row[1] not in ACTIVE:
                    return
                tenant = row[0]
                db.execute("UPDATE batches SET finalizing_at = ? WHERE id = ?", (now, bid))
                if expired:
                    _expire_lines(db, bid)
                ids: dict[int, str | None] = {}
                for ok in (1, 0):
                    results = [bytes(r[0]) for r in db.query(
                        "SELECT result FROM batch_lines WHERE batch_id = ? AND done = 1 AND ok = ? ORDER BY idx",
                        (bid, ok))]
                    ids[ok] = None
                    if results:
                        content = b"\n".join(results) + b"\n"
                        fid = ids[ok] = new_id("file-")
                        db.execute("INSERT INTO batch_files (id, tenant, purpose, filename, bytes, created_at, "
                                   "created_ns, content) VALUES (?, ?, 'batch_output', ?, ?, ?, ?, ?)",
                                   (fid, tenant, f"{bid}_{'output' if ok else 'error'}.jsonl", len(content), now,
                                    time.time_ns(), content))
                status, at = (("expired", "expired_at") if expired else ("cancelled", "cancelled_at") if cancelled
                              else ("completed", "completed_at"))
                db.execute(f"UPDATE batches SET status = ?, {at} = ?, output_file_id = ?, error_file_id = ?, "
                           "lease_until = 0 WHERE id = ?", (status, now, ids[1], ids[0], bid))

        await self._run(lambda: go(self._db))  # type: ignore[arg-type]


_EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window "
                                                "expired."}


def _expire_lines(db: Database, bid: str) -> None:
    """Every line of ``bid`` not done yet: done, failed, with OpenAI's error-file line of an expired request."""
    rows = db.query("SELECT idx, custom_id FROM batch_lines WHERE batch_id = ? AND done = 0", (bid,))
    db.executemany("UPDATE batch_lines SET done = 1, ok = 0, result = ? WHERE batch_id = ? AND idx = ? AND done = 0",
                   [(orjson.dumps({"id": new_id("batch_req_"), "custom_id": cid, "response": None,
                                   "error": _EXPIRED}), bid, idx) for idx, cid in rows])
    db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), bid))

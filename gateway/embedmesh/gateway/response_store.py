"""Where ``/v1/responses`` keeps stored responses: one table in a real database, SQLite (a file, the default) or
PostgreSQL (``--responses-db postgresql://...``), each row owned by a tenant and gone after its TTL.

A row holds the response object as the API shows it (``body``), the conversation up to and including its output
as chat messages (``history``: what a later turn's ``previous_response_id`` continues from), and the turn's own
input items (``items``: what ``GET /v1/responses/{id}/input_items`` lists). Every statement names the tenant, so
another tenant's id reads exactly like an unknown one.

The database is driven from one thread (``ThreadPoolExecutor(max_workers=1)``): the event loop never blocks on
I/O and statements never interleave. Expired rows are invisible at once and deleted on later writes.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from embedmesh.core.logs import get_logger
from embedmesh.gateway.errors import ApiError

__all__ = ["ResponseStore", "Stored", "default_path"]

T = TypeVar("T")
log = get_logger("embedmesh.gateway.responses")

_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
    status TEXT NOT NULL, body TEXT NOT NULL, history TEXT NOT NULL, items TEXT NOT NULL,
    PRIMARY KEY (tenant, id))"""
_PURGE_EVERY_S = 60.0


def _unavailable(e: Exception) -> ApiError:
    log.warning("response store failed: %s", type(e).__name__)
    return ApiError(503, "the response store is unavailable; retry later", code="store_unavailable",
                    type_="service_unavailable")


def default_path() -> str:
    """``$EMBEDMESH_CACHE/responses.sqlite3`` (``~/.cache/embedmesh`` when unset)."""
    root = os.environ.get("EMBEDMESH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "embedmesh")
    return os.path.join(root, "responses.sqlite3")


@dataclass
class Stored:
    """One stored response."""

    id: str
    status: str
    body: dict[str, Any]
    history: list[dict[str, Any]]
    items: list[dict[str, Any]]


class ResponseStore:
    """``target``: a PostgreSQL URL (``postgresql://`` or ``postgres://``) or key=value DSN (with ``dbname=``), a
    SQLite file path, or "" for
    ``default_path()``. ``ttl_seconds``: how long a stored response stays readable after it was last written."""

    def __init__(self, target: str, ttl_seconds: float) -> None:
        self.postgres = target.startswith(("postgresql://", "postgres://")) or "dbname=" in target
        self.target = target if target else default_path()
        self.ttl = ttl_seconds
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-db")
        self._conn: Any = None
        self._last_purge = 0.0

    # --- the database thread -----------------------------------------------------------------------------------
    def _connect(self) -> Any:
        if self._conn is None:
            if self.postgres:
                import psycopg

                self._conn = psycopg.connect(self.target, autocommit=True)
            else:
                if self.target != ":memory:":
                    Path(self.target).parent.mkdir(parents=True, exist_ok=True)
                self._conn = sqlite3.connect(self.target, check_same_thread=False, isolation_level=None)
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(_SCHEMA)
        return self._conn

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql

    def _exec(self, sql: str, params: tuple[Any, ...]) -> Any:
        try:
            return self._connect().execute(self._sql(sql), params)
        except Exception:
            if self.postgres and self._conn is not None and self._conn.closed:
                self._conn = None  # a lost connection: connect again once and retry
                return self._connect().execute(self._sql(sql), params)
            raise

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn`` on the database thread; a database that fails (down, disk full, locked) is a 503 to retry."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except (sqlite3.Error, OSError) as e:
            raise _unavailable(e) from None
        except Exception as e:
            if type(e).__module__.startswith("psycopg"):
                raise _unavailable(e) from None
            raise

    # --- the API ---------------------------------------------------------------------------------------------------
    async def open(self) -> None:
        await self._run(self._connect)

    async def close(self) -> None:
        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        await self._run(shut)
        self._pool.shutdown(wait=False)

    async def put(self, tenant: str, stored: Stored) -> None:
        """Insert or replace the response ``stored.id`` of ``tenant``; its TTL starts again."""
        now = time.time()
        row = (tenant, stored.id, int(stored.body.get("created_at") or now), int(now + self.ttl), stored.status,
               orjson.dumps(stored.body).decode(), orjson.dumps(stored.history).decode(),
               orjson.dumps(stored.items).decode())

        def write() -> None:
            self._exec("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, stored.id))
            self._exec("INSERT INTO responses (tenant, id, created_at, expires_at, status, body, history, items) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
            if now - self._last_purge > _PURGE_EVERY_S:
                self._last_purge = now
                self._exec("DELETE FROM responses WHERE expires_at <= ?", (int(now),))
        await self._run(write)

    async def get(self, tenant: str, rid: str) -> Stored | None:
        """The response, or None when unknown, expired or another tenant's."""
        def read() -> Any:
            return self._exec("SELECT id, status, body, history, items FROM responses WHERE tenant = ? AND id = ? "
                              "AND expires_at > ?", (tenant, rid, int(time.time()))).fetchone()
        row = await self._run(read)
        if row is None:
            return None
        return Stored(row[0], row[1], orjson.loads(row[2]), orjson.loads(row[3]), orjson.loads(row[4]))

    async def set_if(self, tenant: str, rid: str, allowed: tuple[str, ...], stored: Stored) -> bool:
        """Replace the response only while its status is one of ``allowed`` (a background run finishing must not
        overwrite a cancellation made meanwhile, here or on another gateway). True when it was replaced."""
        body = orjson.dumps(stored.body).decode()
        history = orjson.dumps(stored.history).decode()
        marks = ", ".join("?" for _ in allowed)

        def write() -> int:
            cur = self._exec(f"UPDATE responses SET status = ?, body = ?, history = ? WHERE tenant = ? AND id = ? "
                             f"AND status IN ({marks})", (stored.status, body, history, tenant, rid, *allowed))
            return int(cur.rowcount or 0)
        return await self._run(write) > 0

    async def delete(self, tenant: str, rid: str) -> bool:
        def write() -> int:
            cur = self._exec("DELETE FROM responses WHERE tenant = ? AND id = ? AND expires_at > ?",
                             (tenant, rid, int(time.time())))
            return int(cur.rowcount or 0)
        return await self._run(write) > 0

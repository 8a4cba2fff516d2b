"""One SQL connection (SQLite or PostgreSQL) driven from one thread, so the asyncio loop never blocks on I/O and
statements never interleave. SQL is written with ``?`` placeholders and rewritten to ``%s`` for psycopg.

For SQLite files, ``reading()`` gives any other thread its own connection for read-only statements (WAL: it reads
while the writer writes and sees every committed write), so a search can read the rows it needs in the thread that
searched the index, without queueing behind writes or crossing to the database thread."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

__all__ = ["Database"]

T = TypeVar("T")


class Database:
    """``dialect`` is "sqlite" or "postgres". Use ``await db.run(fn)`` to call a synchronous ``fn(db)`` on the
    database thread; inside it, ``execute``/``query``/``transaction``."""

    def __init__(self, dialect: Literal["sqlite", "postgres"], conn: Any, path: str = "", *,
                 threaded: bool = True) -> None:
        """``threaded=False``: a reader's Database (``reading``), used from its own thread only, without ``run``."""
        self.dialect = dialect
        self._conn = conn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vs-db-{dialect}") if threaded else None
        self._local = threading.local()
        self._path = path
        """The SQLite file (readers open it too); empty for PostgreSQL and in-memory databases."""
        self._readers: list[Database] = []
        self._readers_lock = threading.Lock()
        self._dsn = ""
        """PostgreSQL: where ``run`` connects again once the connection is lost (a restart, a network cut)."""

    @classmethod
    def sqlite(cls, path: str) -> Database:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # WAL: readers never block the writer; synchronous=NORMAL is durable across a process crash.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return cls("sqlite", conn, "" if path == ":memory:" or path.startswith("file:") else path)

    @property
    def has_readers(self) -> bool:
        """Whether ``reading`` gives other threads connections of their own."""
        return bool(self._path)

    def reading(self) -> Database | None:
        """A Database on this thread's own read-only connection to the same SQLite file (opened on first use, kept
        for the thread), to run read-only statements from the calling thread directly — not through ``run``.
        None for PostgreSQL and in-memory SQLite (their reads stay on ``run``)."""
        if not self._path:
            return None
        reader: Database | None = getattr(self._local, "reader", None)
        if reader is None:
            conn = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA query_only=ON")
            reader = Database("sqlite", conn, threaded=False)
            with self._readers_lock:
                self._readers.append(reader)
            self._local.reader = reader
        return reader

    @classmethod
    def postgres(cls, dsn: str) -> Database:
        import psycopg

        db = cls("postgres", psycopg.connect(dsn, autocommit=True))
        db._dsn = dsn
        return db

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.dialect == "postgres" else sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; returns the row count."""
        cur = self._conn.execute(self._sql(sql), tuple(params))
        return int(cur.rowcount or 0)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if self.dialect == "postgres":
            with self._conn.cursor() as cur:
                cur.executemany(self._sql(sql), rows)
        else:
            self._conn.executemany(sql, rows)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self._conn.execute(self._sql(sql), tuple(params)).fetchall())

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All or nothing; nests (inner blocks join the outer transaction)."""
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = depth
            return
        self._local.depth = 1
        try:
            if self.dialect == "postgres":
                with self._conn.transaction():
                    yield
            else:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
        finally:
            self._local.depth = 0

    @property
    def connection(self) -> Any:
        return self._conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("a reader runs its statements on its own thread, not through run")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._on_live_connection, fn, *args)

    def _on_live_connection(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` (on the database thread); a PostgreSQL connection found closed (the server restarted, the
        network dropped it) is opened again first. The statement that found it broken has failed already, and its
        caller decides whether to retry; without this every later statement would fail too, for good."""
        if self._dsn and self._conn.closed:
            import psycopg

            self._conn = psycopg.connect(self._dsn, autocommit=True)
        return fn(*args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._readers_lock:
            readers, self._readers = self._readers, []
        for reader in readers:
            reader._conn.close()
        self._conn.close()

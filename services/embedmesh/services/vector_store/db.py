"""One SQL connection (SQLite or PostgreSQL) driven from one thread, so the asyncio loop never blocks on I/O and
statements never interleave. SQL is written with ``?`` placeholders and rewritten to ``%s`` for psycopg."""

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

    def __init__(self, dialect: Literal["sqlite", "postgres"], conn: Any) -> None:
        self.dialect = dialect
        self._conn = conn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vs-db-{dialect}")
        self._local = threading.local()

    @classmethod
    def sqlite(cls, path: str) -> Database:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # WAL: readers never block the writer; synchronous=NORMAL is durable across a process crash.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return cls("sqlite", conn)

    @classmethod
    def postgres(cls, dsn: str) -> Database:
        import psycopg

        return cls("postgres", psycopg.connect(dsn, autocommit=True))

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
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._conn.close()

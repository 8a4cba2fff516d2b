"""PostgreSQL + pgvector index: the chunk rows (``vs_chunks.embedding vector(d)``) carry an HNSW index with cosine
distance, and each chunk row carries its file's attributes as jsonb, so a filter becomes part of the SQL WHERE
(``filters.to_sql``) and pgvector 0.8's iterative index scan (``hnsw.iterative_scan = relaxed_order``) keeps
walking the graph until ``k`` rows pass it. Nothing to add or remove here: committing the rows indexes them.

Searches use their own connection (and thread) so they do not queue behind ingestion writes.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from embedmesh.services.vector_store.filters import Filter, to_sql
from embedmesh.services.vector_store.index.base import Hit, VectorIndex
from embedmesh.services.vector_store.store import MetadataStore, vector_literal

__all__ = ["PgVectorIndex"]


class PgVectorIndex(VectorIndex):
    name = "pgvector"
    pushes_down_filters = True

    def __init__(self, store: MetadataStore, dsn: str, *, m: int = 16, ef_construction: int = 64,
                 ef_search: int = 128, search_connections: int = 1) -> None:
        self.store = store
        self.dsn = dsn
        self.m = m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self._pool = ThreadPoolExecutor(max_workers=search_connections, thread_name_prefix="vs-pgvector")
        self._conns: list[Any] = []
        self._local: Any = None

    async def open(self) -> None:
        import threading

        self._local = threading.local()
        await self.store.db.run(self._create_index)

    def _create_index(self) -> None:
        self.store.db.execute(
            f"CREATE INDEX IF NOT EXISTS vs_chunks_hnsw ON vs_chunks USING hnsw (embedding vector_cosine_ops) "
            f"WITH (m = {int(self.m)}, ef_construction = {int(self.ef_construction)})")

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:  # closed: lost with a server restart; connect again
            import psycopg

            conn = psycopg.connect(self.dsn, autocommit=True)
            self._local.conn = conn
            self._conns.append(conn)
        return conn

    async def added(self, store_id: str, file_id: str, ids: list[int], vectors: np.ndarray) -> None:
        return None

    async def removed(self, store_id: str, ids: list[int]) -> None:
        return None

    async def dropped(self, store_id: str) -> None:
        return None

    async def search(self, store_id: str, query: np.ndarray, k: int, flt: Filter | None,
                     allowed: dict[str, int] | None) -> list[Hit]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._search, store_id, query, k, flt)

    def _search(self, store_id: str, query: np.ndarray, k: int, flt: Filter | None) -> list[Hit]:
        q = vector_literal(np.asarray(query, dtype=np.float32).reshape(-1))
        where, params = "store_id = %s", [store_id]
        if flt is not None:
            sql, p = to_sql(flt, "attributes")
            where += f" AND ({sql})"
            params.extend(p)
        conn = self._conn()
        with conn.transaction():
            conn.execute(f"SET LOCAL hnsw.ef_search = {int(max(self.ef_search, k))}")
            conn.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
            rows = conn.execute(f"SELECT id, embedding <=> %s::vector AS d FROM vs_chunks WHERE {where} "
                                f"ORDER BY d LIMIT %s", [q, *params, k]).fetchall()
        # relaxed_order may return neighbours slightly out of order.
        hits = sorted(((int(r[0]), 1.0 - float(r[1])) for r in rows), key=lambda h: -h[1])
        return hits

    async def close(self) -> None:
        def shut() -> None:
            for c in self._conns:
                c.close()

        await asyncio.get_running_loop().run_in_executor(self._pool, shut)
        self._pool.shutdown(wait=True)

"""Both index backends behind one interface: recall@10 against exact search (unfiltered and filtered), and the
index surviving a restart — for the embedded index also a graph on disk that lags the chunk rows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.services.vector_store.chunking import Chunk
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.filters import Comparison
from embedmesh.services.vector_store.index.base import VectorIndex
from embedmesh.services.vector_store.objects import AUTO_CHUNKING
from embedmesh.services.vector_store.store import MetadataStore

DIM = 64
TENANT = "t"
N_FILES = 30
PER_FILE = 100


def clustered(n: int, rng: np.random.Generator, centers: np.ndarray) -> np.ndarray:
    x = centers[rng.integers(0, len(centers), n)] + 0.35 * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


class Fixture:
    """A store, its index, and what was put in it (for exact answers)."""

    def __init__(self, backend: str, tmp: Path, pg: Any) -> None:
        self.backend, self.tmp = backend, tmp
        self.dsn = pg.database() if backend == "pgvector" else ""
        self.vectors: dict[int, np.ndarray] = {}
        self.file_of: dict[int, str] = {}

    async def open(self, exact_below: int = 0) -> tuple[MetadataStore, VectorIndex]:
        if self.backend == "pgvector":
            from embedmesh.services.vector_store.index.pgvector import PgVectorIndex

            store = MetadataStore(Database.postgres(self.dsn), DIM, "m")
            store.init_schema()
            index: VectorIndex = PgVectorIndex(store, self.dsn, ef_search=64)
        else:
            from embedmesh.services.vector_store.index.embedded import EmbeddedIndex

            store = MetadataStore(Database.sqlite(str(self.tmp / "db.sqlite3")), DIM, "m")
            store.init_schema()
            index = EmbeddedIndex(store, str(self.tmp / "index"), DIM, ef_search=64, exact_below=exact_below,
                                  flush_seconds=3600)
        await index.open()
        return store, index

    async def add_file(self, store: MetadataStore, index: VectorIndex, store_id: str, name: str,
                       vectors: np.ndarray, attrs: dict[str, Any]) -> str:
        f = store.create_file(TENANT, name, "assistants", "text/plain", b"x")
        _, pending, _ = store.add_store_file(TENANT, store_id, f.id, AUTO_CHUNKING, attrs)
        chunks = [Chunk(i, f"{name} chunk {i}", 1) for i in range(len(vectors))]
        ids = store.complete(pending, chunks, vectors)
        assert ids is not None
        await index.added(store_id, f.id, ids, vectors)
        for cid, v in zip(ids, vectors, strict=True):
            self.vectors[cid], self.file_of[cid] = v, f.id
        return f.id

    def exact(self, q: np.ndarray, k: int, files: set[str] | None = None) -> list[int]:
        ids = [c for c in self.vectors if files is None or self.file_of[c] in files]
        scores = np.stack([self.vectors[c] for c in ids]) @ q
        return [ids[i] for i in np.argsort(-scores)[:k]]


def recall(got: list[int], want: list[int]) -> float:
    return len(set(got) & set(want)) / max(1, len(want))


@pytest.fixture
def pg_or_none(backend: str, request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("pg") if backend == "pgvector" else None


async def test_recall_vs_exact(backend: str, tmp_path: Path, pg_or_none: Any) -> None:
    fx = Fixture(backend, tmp_path, pg_or_none)
    store, index = await fx.open()
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((20, DIM))
    sid = store.create_store(TENANT, "r", None, {})
    group: dict[str, str] = {}
    for i in range(N_FILES):
        g = "rare" if i < 2 else ("half" if i % 2 else "other")
        fid = await fx.add_file(store, index, sid, f"f{i}", clustered(PER_FILE, rng, centers), {"g": g})
        group[fid] = g
    queries = clustered(40, rng, centers)
    for flt, files in [(None, None),
                       (Comparison("g", "eq", "half"), {f for f, g in group.items() if g == "half"}),
                       (Comparison("g", "eq", "rare"), {f for f, g in group.items() if g == "rare"})]:
        allowed = None if files is None else {f: PER_FILE for f in files}
        r = []
        for q in queries:
            hits = await index.search(sid, q, 10, flt, allowed)
            assert all(fx.file_of[c] in (files or fx.file_of.values()) for c, _ in hits)
            assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
            r.append(recall([c for c, _ in hits], fx.exact(q, 10, files)))
        assert np.mean(r) >= 0.95, (flt, np.mean(r))
    await index.close()
    store.db.close()


async def test_survives_restart(backend: str, tmp_path: Path, pg_or_none: Any) -> None:
    fx = Fixture(backend, tmp_path, pg_or_none)
    store, index = await fx.open()
    rng = np.random.default_rng(1)
    centers = rng.standard_normal((5, DIM))
    sid = store.create_store(TENANT, "p", None, {})
    first = await fx.add_file(store, index, sid, "a", clustered(200, rng, centers), {})
    queries = clustered(10, rng, centers)
    before = [[c for c, _ in await index.search(sid, q, 10, None, None)] for q in queries]
    await index.close()
    graph = tmp_path / "index" / f"{sid}.hnsw"
    stale_copy = tmp_path / "stale.hnsw"
    if backend == "embedded":
        assert graph.exists()
        shutil.copy(graph, stale_copy)
    store.db.close()

    store, index = await fx.open()
    after = [[c for c, _ in await index.search(sid, q, 10, None, None)] for q in queries]
    assert after == before
    if backend == "pgvector":
        await index.close()
        store.db.close()
        return
    # The graph on disk lags the rows: file b is added and file a removed, then the old graph is put back
    # (as if the process died before its next flush). Loading reconciles it with the rows.
    second = await fx.add_file(store, index, sid, "b", clustered(200, rng, centers), {})
    removed = store.delete_store_file(sid, first)
    await index.removed(sid, removed)
    for c in removed:
        del fx.vectors[c]
    await index.close()
    store.db.close()
    os.replace(stale_copy, graph)
    store, index = await fx.open()
    for q in queries:
        hits = [c for c, _ in await index.search(sid, q, 10, None, None)]
        assert all(fx.file_of[c] == second for c in hits) and len(hits) == 10
        assert recall(hits, fx.exact(q, 10)) >= 0.8
    await index.close()
    store.db.close()

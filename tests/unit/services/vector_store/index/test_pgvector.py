"""vector_store.index.pgvector on a real PostgreSQL + pgvector: ``open`` builds the HNSW cosine index with the
configured graph settings; a search answers only the store's chunks, best first, with similarity = 1 - cosine
distance; filters are pushed down into SQL over the chunk rows' attributes; committed rows need no add/remove."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from embedmesh.services.vector_store.chunking import Chunk
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.filters import Comparison, Compound
from embedmesh.services.vector_store.index.pgvector import PgVectorIndex
from embedmesh.services.vector_store.objects import AUTO_CHUNKING
from embedmesh.services.vector_store.store import MetadataStore

DIM = 8
TENANT = "t"


def unit(*xs: float) -> np.ndarray:
    v = np.zeros(DIM, np.float32)
    v[: len(xs)] = xs
    return v / np.linalg.norm(v)


def add_file(store: MetadataStore, store_id: str, name: str, vectors: list[np.ndarray],
             attrs: dict[str, Any]) -> tuple[str, list[int]]:
    f = store.create_file(TENANT, name, "assistants", "text/plain", b"x")
    _, pending, _ = store.add_store_file(TENANT, store_id, f.id, AUTO_CHUNKING, attrs)
    ids = store.complete(pending, [Chunk(i, f"{name} {i}", 1) for i in range(len(vectors))], np.stack(vectors))
    assert ids is not None
    return f.id, ids


@pytest.fixture
async def pgv(pg: Any) -> AsyncIterator[tuple[MetadataStore, PgVectorIndex, str]]:
    dsn = pg.database()
    store = MetadataStore(Database.postgres(dsn), DIM, "m")
    store.init_schema()
    index = PgVectorIndex(store, dsn, m=12, ef_construction=40, ef_search=16)
    await index.open()
    yield store, index, dsn
    await index.close()
    store.db.close()


async def test_open_builds_the_hnsw_cosine_index(pgv: tuple[MetadataStore, PgVectorIndex, str]) -> None:
    store, index, _ = pgv
    assert index.name == "pgvector" and index.pushes_down_filters
    (definition,) = store.db.one("SELECT indexdef FROM pg_indexes WHERE indexname = 'vs_chunks_hnsw'")  # type: ignore[misc]
    assert "USING hnsw (embedding vector_cosine_ops)" in definition
    assert "m='12'" in definition and "ef_construction='40'" in definition
    await index.open()  # opening again keeps the index
    assert store.db.one("SELECT count(*) FROM pg_indexes WHERE indexname = 'vs_chunks_hnsw'") == (1,)


async def test_search_ranks_the_stores_chunks_by_cosine(pgv: tuple[MetadataStore, PgVectorIndex, str]) -> None:
    store, index, _ = pgv
    s1 = store.create_store(TENANT, "one", None, {})
    s2 = store.create_store(TENANT, "two", None, {})
    _, ids = add_file(store, s1, "a", [unit(1, 0), unit(1, 1), unit(0, 1)], {})
    _, other = add_file(store, s2, "b", [unit(1, 0)], {})
    hits = await index.search(s1, unit(1, 0), 3, None, None)
    assert [h[0] for h in hits] == ids  # (1,0) then (1,1) then (0,1)
    assert hits[0][1] == pytest.approx(1.0, abs=1e-5)
    assert hits[1][1] == pytest.approx(float(np.sqrt(0.5)), abs=1e-5)
    assert hits[2][1] == pytest.approx(0.0, abs=1e-5)
    assert other[0] not in {h[0] for h in hits}, "another store's chunk is never answered"
    assert [h[0] for h in await index.search(s1, unit(0, 1), 1, None, None)] == [ids[2]]
    assert await index.search(store.create_store(TENANT, "empty", None, {}), unit(1), 5, None, None) == []


async def test_filters_are_pushed_down(pgv: tuple[MetadataStore, PgVectorIndex, str]) -> None:
    store, index, _ = pgv
    sid = store.create_store(TENANT, "s", None, {})
    _, near = add_file(store, sid, "near", [unit(1, 0)], {"lang": "en", "year": 2020})
    _, far = add_file(store, sid, "far", [unit(0, 1)], {"lang": "fr", "year": 2024})
    got = await index.search(sid, unit(1, 0), 5, Comparison("lang", "eq", "fr"), None)
    assert [h[0] for h in got] == far, "the nearest chunk fails the filter: only the other is answered"
    got = await index.search(sid, unit(1, 0), 5, Compound("or", (Comparison("year", "lt", 2021),
                                                                 Comparison("lang", "eq", "fr"))), None)
    assert [h[0] for h in got] == near + far
    assert await index.search(sid, unit(1, 0), 5, Comparison("lang", "eq", "de"), None) == []


async def test_rows_are_the_index(pgv: tuple[MetadataStore, PgVectorIndex, str]) -> None:
    store, index, _ = pgv
    sid = store.create_store(TENANT, "s", None, {})
    fid, ids = add_file(store, sid, "a", [unit(1, 0), unit(0, 1)], {})
    await index.added(sid, fid, ids, np.stack([unit(1, 0), unit(0, 1)]))  # nothing to do: already searchable
    assert len(await index.search(sid, unit(1, 0), 5, None, None)) == 2
    removed = store.delete_store_file(sid, fid)
    await index.removed(sid, removed)
    assert await index.search(sid, unit(1, 0), 5, None, None) == [], "deleted rows are gone from the index"


async def test_k_above_ef_search_still_returns_k(pgv: tuple[MetadataStore, PgVectorIndex, str]) -> None:
    store, index, _ = pgv  # ef_search=16: the search raises it to k
    sid = store.create_store(TENANT, "s", None, {})
    rng = np.random.default_rng(1)
    vecs = [v / np.linalg.norm(v) for v in rng.standard_normal((60, DIM)).astype(np.float32)]
    add_file(store, sid, "many", vecs, {})
    assert len(await index.search(sid, vecs[0], 40, None, None)) == 40

"""vector_store.index.embedded (hnswlib over SQLite rows), called directly: search best first with similarity =
inner product of unit vectors; removed chunks and dropped stores are gone; a filter keeps only allowed files (the
over-fetch, and the exact search over stored vectors when few chunks are allowed); the graph is saved on flush and,
when loaded, reconciled with the rows (chunks added while it lagged are added, deleted ones never answered)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.services.vector_store.chunking import Chunk
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.index.embedded import EmbeddedIndex
from embedmesh.services.vector_store.objects import AUTO_CHUNKING
from embedmesh.services.vector_store.store import MetadataStore

pytest.importorskip("hnswlib")

DIM = 8
TENANT = "t"


def unit(*xs: float) -> np.ndarray:
    v = np.zeros(DIM, np.float32)
    v[: len(xs)] = xs
    return v / np.linalg.norm(v)


def rows_only(store: MetadataStore, store_id: str, name: str, vectors: list[np.ndarray],
              attrs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """Commit a file's chunk rows without telling the index (what a crash before a flush leaves)."""
    f = store.create_file(TENANT, name, "assistants", "text/plain", b"x")
    _, pending, _ = store.add_store_file(TENANT, store_id, f.id, AUTO_CHUNKING, attrs or {})
    ids = store.complete(pending, [Chunk(i, f"{name} {i}", 1) for i in range(len(vectors))], np.stack(vectors))
    assert ids is not None
    return f.id, ids


async def add(store: MetadataStore, index: EmbeddedIndex, store_id: str, name: str,
              vectors: list[np.ndarray]) -> tuple[str, list[int]]:
    fid, ids = rows_only(store, store_id, name, vectors)
    await index.added(store_id, fid, ids, np.stack(vectors))
    return fid, ids


@pytest.fixture
def store(tmp_path: Path) -> MetadataStore:
    s = MetadataStore(Database.sqlite(str(tmp_path / "db.sqlite3")), DIM, "m")
    s.init_schema()
    return s


def new_index(store: MetadataStore, tmp_path: Path, **kw: Any) -> EmbeddedIndex:
    return EmbeddedIndex(store, str(tmp_path / "index"), DIM, flush_seconds=3600, **kw)


@pytest.fixture
async def index(store: MetadataStore, tmp_path: Path) -> AsyncIterator[EmbeddedIndex]:
    ix = new_index(store, tmp_path)
    await ix.open()
    yield ix
    await ix.close()


async def test_search_is_best_first_by_inner_product(store: MetadataStore, index: EmbeddedIndex) -> None:
    sid = store.create_store(TENANT, "s", None, {})
    _, ids = await add(store, index, sid, "a", [unit(1, 0), unit(1, 1), unit(0, 1)])
    hits = await index.search(sid, unit(1, 0), 3, None, None)
    assert [h[0] for h in hits] == ids
    assert [h[1] for h in hits] == pytest.approx([1.0, float(np.sqrt(0.5)), 0.0], abs=1e-5)
    assert [h[0] for h in await index.search(sid, unit(0, 1), 10, None, None)][0] == ids[2]  # k above the count
    assert not index.pushes_down_filters and index.name == "embedded"


async def test_stores_have_separate_graphs(store: MetadataStore, index: EmbeddedIndex) -> None:
    s1, s2 = store.create_store(TENANT, "1", None, {}), store.create_store(TENANT, "2", None, {})
    _, a = await add(store, index, s1, "a", [unit(1, 0)])
    _, b = await add(store, index, s2, "b", [unit(1, 0)])
    assert [h[0] for h in await index.search(s1, unit(1, 0), 5, None, None)] == a
    assert [h[0] for h in await index.search(s2, unit(1, 0), 5, None, None)] == b


async def test_removed_chunks_and_dropped_stores_are_gone(store: MetadataStore, index: EmbeddedIndex,
                                                          tmp_path: Path) -> None:
    sid = store.create_store(TENANT, "s", None, {})
    _, ids = await add(store, index, sid, "a", [unit(1, 0), unit(0, 1)])
    await index.removed(sid, [ids[0]])
    assert [h[0] for h in await index.search(sid, unit(1, 0), 5, None, None)] == [ids[1]]
    await index.removed(sid, [ids[0]])  # twice is harmless
    await index.flush()
    path = tmp_path / "index" / f"{sid}.hnsw"
    assert path.exists()
    await index.dropped(sid)
    assert not path.exists()


async def test_filters_keep_only_the_allowed_files(store: MetadataStore, index: EmbeddedIndex) -> None:
    sid = store.create_store(TENANT, "s", None, {})
    rng = np.random.default_rng(3)
    near_vectors = [unit(1, 0.01 * i) for i in range(40)]
    near, _ = await add(store, index, sid, "near", near_vectors)
    far, far_ids = await add(store, index, sid, "far", [unit(0, 1), unit(0.1, 1)])
    _, noise = await add(store, index, sid, "noise", [v / np.linalg.norm(v) for v in
                                                       rng.standard_normal((40, DIM)).astype(np.float32)])
    got = await index.search(sid, unit(1, 0), 5, None, {far: 2})
    assert sorted(h[0] for h in got) == sorted(far_ids), "only the allowed file's chunks, however far"
    assert got[0][1] >= got[1][1]
    assert await index.search(sid, unit(1, 0), 5, None, {"file-unknown": 3}) == []
    got = await index.search(sid, unit(1, 0), 3, None, {near: 40, far: 2})
    assert len(got) == 3 and all(h[0] not in noise and h[0] not in far_ids for h in got)


async def test_exact_search_when_the_over_fetch_comes_up_short(store: MetadataStore, tmp_path: Path) -> None:
    ix = new_index(store, tmp_path, max_overfetch=2)  # the graph may only be asked for 2 neighbours
    await ix.open()
    try:
        sid = store.create_store(TENANT, "s", None, {})
        await add(store, ix, sid, "crowd", [unit(1, 0.01 * i) for i in range(30)])
        rare, rare_ids = await add(store, ix, sid, "rare", [unit(0, 1), unit(0.2, 1)])
        got = await ix.search(sid, unit(1, 0), 2, None, {rare: 2})
        assert [h[0] for h in got] == [rare_ids[1], rare_ids[0]], "found exactly over the stored vectors"
        assert got[0][1] == pytest.approx(float(unit(1, 0) @ unit(0.2, 1)), abs=1e-5)
    finally:
        await ix.close()


async def test_a_lagging_graph_is_reconciled_with_the_rows(store: MetadataStore, tmp_path: Path) -> None:
    ix = new_index(store, tmp_path)
    await ix.open()
    sid = store.create_store(TENANT, "s", None, {})
    gone_file, gone = await add(store, ix, sid, "gone", [unit(1, 0)])
    _, kept = await add(store, ix, sid, "kept", [unit(0, 1)])
    await ix.close()  # saved with both files
    assert os.path.exists(tmp_path / "index" / f"{sid}.hnsw")
    store.delete_store_file(sid, gone_file)  # rows change while the graph is not looking
    _, late = rows_only(store, sid, "late", [unit(1, 0.1)])

    again = new_index(store, tmp_path)
    await again.open()
    try:
        hits = await again.search(sid, unit(1, 0), 5, None, None)
        assert [h[0] for h in hits] == [*late, *kept], "the late rows are added, the deleted ones never answered"
        assert gone[0] not in {h[0] for h in hits}
    finally:
        await again.close()


async def test_an_unreadable_graph_file_is_rebuilt_from_the_rows(store: MetadataStore, tmp_path: Path) -> None:
    sid = store.create_store(TENANT, "s", None, {})
    _, ids = rows_only(store, sid, "a", [unit(1, 0), unit(0, 1)])
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / f"{sid}.hnsw").write_bytes(b"not an hnsw graph")
    ix = new_index(store, tmp_path)
    await ix.open()
    try:
        assert [h[0] for h in await ix.search(sid, unit(0, 1), 5, None, None)] == [ids[1], ids[0]]
    finally:
        await ix.close()


async def test_the_graph_grows_past_its_first_capacity(store: MetadataStore, index: EmbeddedIndex) -> None:
    sid = store.create_store(TENANT, "s", None, {})
    rng = np.random.default_rng(0)
    vectors = [v / np.linalg.norm(v) for v in rng.standard_normal((1500, DIM)).astype(np.float32)]
    _, ids = await add(store, index, sid, "big", vectors)  # capacity starts at 1024
    hits = await index.search(sid, vectors[1400], 1, None, None)
    assert hits[0][0] == ids[1400] and hits[0][1] == pytest.approx(1.0, abs=1e-4)

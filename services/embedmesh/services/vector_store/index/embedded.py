"""Embedded approximate index: one hnswlib HNSW graph (inner product over unit vectors = cosine) per vector store,
saved under ``<data_dir>/index/<store_id>.hnsw``.

Persistence: the SQLite chunk rows are the truth; a graph on disk may lag them (it is written every
``flush_seconds`` and at shutdown, atomically by rename). When a store's graph is loaded it is reconciled with the
rows: chunks missing from the graph are added from their stored vectors, labels whose rows are gone are marked
deleted. So a crash costs at most a re-add, never a wrong or missing result.

Filters are post-filters with over-fetch: the caller resolves the filter to the allowed files (file attributes live
in the metadata store); the graph is asked for ``k * total / allowed * 4`` neighbours (at least k, at most
``max_overfetch``) and the allowed ones kept. When fewer than ``k`` survive (a very selective filter): if the allowed
files hold at most ``exact_below`` chunks, their stored vectors are searched exactly; otherwise the graph is walked
again with the allowed labels as hnswlib's in-traversal filter.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from embedmesh.core.logs import get_logger
from embedmesh.services.vector_store.filters import Filter
from embedmesh.services.vector_store.index.base import Hit, VectorIndex
from embedmesh.services.vector_store.store import MetadataStore

__all__ = ["EmbeddedIndex"]

log = get_logger(__name__)


class _Graph:
    """One store's HNSW graph and the label -> file map. Every use holds ``lock`` (resize is not thread safe)."""

    def __init__(self, index: Any, file_of: dict[int, str]) -> None:
        self.index = index
        self.file_of = file_of
        self.by_file: dict[str, set[int]] = defaultdict(set)
        for label, f in file_of.items():
            self.by_file[f].add(label)
        self.lock = threading.Lock()
        self.dirty = False

    def add(self, labels: list[int], file_ids: list[str], vectors: np.ndarray) -> None:
        if not labels:
            return
        need = self.index.get_current_count() + len(labels)
        if need > self.index.get_max_elements():
            self.index.resize_index(max(need, 2 * self.index.get_max_elements()))
        # Bulk adds (a large file, a rebuild from the rows) use every core; small ones stay on this thread.
        self.index.add_items(vectors, np.asarray(labels, dtype=np.int64), num_threads=1 if len(labels) < 1024 else -1)
        for label, f in zip(labels, file_ids, strict=True):
            self.file_of[label] = f
            self.by_file[f].add(label)
        self.dirty = True

    def remove(self, labels: list[int]) -> None:
        for label in labels:
            f = self.file_of.pop(label, None)
            if f is None:
                continue
            self.by_file[f].discard(label)
            if not self.by_file[f]:
                del self.by_file[f]
            try:
                self.index.mark_deleted(label)
            except RuntimeError:  # already deleted in a graph saved after the delete
                pass
        self.dirty = True


class EmbeddedIndex(VectorIndex):
    name = "embedded"

    def __init__(self, store: MetadataStore, folder: str, dimensions: int, *, m: int = 16,
                 ef_construction: int = 200, ef_search: int = 128, exact_below: int = 2048,
                 flush_seconds: float = 5.0, max_overfetch: int = 4096) -> None:
        self.store = store
        self.folder = folder
        self.dim = dimensions
        self.m = m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self.exact_below = exact_below
        self.flush_seconds = flush_seconds
        self.max_overfetch = max_overfetch
        self._graphs: dict[str, _Graph] = {}
        self._loading: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._flusher: asyncio.Task[None] | None = None

    def _path(self, store_id: str) -> str:
        return os.path.join(self.folder, f"{store_id}.hnsw")

    async def open(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        self._flusher = asyncio.create_task(self._flush_loop())

    def _new_index(self, capacity: int) -> Any:
        import hnswlib

        index = hnswlib.Index(space="ip", dim=self.dim)
        index.init_index(max_elements=max(capacity, 1024), ef_construction=self.ef_construction, M=self.m,
                         random_seed=7)
        return index

    async def _graph(self, store_id: str) -> _Graph:
        g = self._graphs.get(store_id)
        if g is not None:
            return g
        async with self._loading[store_id]:
            g = self._graphs.get(store_id)
            if g is None:
                rows = await self.store.db.run(self.store.chunk_ids, store_id)
                g, missing = await asyncio.to_thread(self._load, store_id, rows)
                if missing:
                    vectors = await self.store.db.run(self.store.chunk_vectors, [c for c, _ in missing])
                    await asyncio.to_thread(g.add, [c for c, _ in missing], [f for _, f in missing], vectors)
                    log.info("index reconciled: chunks added from their rows",
                             extra={"store": store_id, "added": len(missing)})
                self._graphs[store_id] = g
        return g

    def _load(self, store_id: str, rows: list[tuple[int, str]]) -> tuple[_Graph, list[tuple[int, str]]]:
        """Open the saved graph (or a new one), drop labels whose rows are gone, and return the graph with the
        (chunk id, file id) rows it lacks."""
        import hnswlib

        truth = dict(rows)
        path = self._path(store_id)
        index = None
        if os.path.exists(path):
            try:
                index = hnswlib.Index(space="ip", dim=self.dim)
                index.load_index(path, max_elements=0)
            except RuntimeError:
                log.warning("unreadable index file; rebuilding from the chunk rows", extra={"path": path})
                index = None
        if index is None:
            index = self._new_index(2 * len(truth))
            present: set[int] = set()
        else:
            present = set(int(x) for x in index.get_ids_list())
        g = _Graph(index, {})
        # Labels in the graph whose rows exist are live; deleted-marked ones were removed from the rows too.
        stale = [label for label in present if label not in truth]
        for label in stale:
            try:
                index.mark_deleted(label)
            except RuntimeError:
                pass
        for label in present:
            if label in truth:
                g.file_of[label] = truth[label]
                g.by_file[truth[label]].add(label)
        if stale:
            g.dirty = True
            log.info("index reconciled: stale labels removed", extra={"store": store_id, "removed": len(stale)})
        return g, [(cid, f) for cid, f in truth.items() if cid not in present]

    async def added(self, store_id: str, file_id: str, ids: list[int], vectors: np.ndarray) -> None:
        g = await self._graph(store_id)

        def run() -> None:
            with g.lock:
                g.add(ids, [file_id] * len(ids), np.ascontiguousarray(vectors, dtype=np.float32))

        await asyncio.to_thread(run)

    async def removed(self, store_id: str, ids: list[int]) -> None:
        if not ids:
            return
        g = await self._graph(store_id)

        def run() -> None:
            with g.lock:
                g.remove(ids)

        await asyncio.to_thread(run)

    async def dropped(self, store_id: str) -> None:
        g = self._graphs.pop(store_id, None)
        if g is not None:
            with g.lock:
                g.dirty = False
        try:
            os.remove(self._path(store_id))
        except FileNotFoundError:
            pass

    async def search(self, store_id: str, query: np.ndarray, k: int, flt: Filter | None,
                     allowed: dict[str, int] | None) -> list[Hit]:
        g = await self._graph(store_id)
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1)
        hits, labels = await asyncio.to_thread(self._search, g, q, k, allowed)
        if hits is not None:
            return hits
        # Few allowed chunks and the over-fetch came up short: exact over their stored vectors.
        vectors = await self.store.db.run(self.store.chunk_vectors, labels)
        scores = vectors @ q[0]
        top = np.argsort(-scores)[:k]
        return [(labels[i], float(scores[i])) for i in top]

    def search_now(self, store_id: str, query: np.ndarray, k: int) -> list[Hit] | None:
        """An unfiltered search of a graph already loaded, in the calling thread (the graph's lock held)."""
        g = self._graphs.get(store_id)
        if g is None:
            return None
        hits, _ = self._search(g, np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1), k, None)
        return hits

    def _search(self, g: _Graph, q: np.ndarray, k: int,
                allowed: dict[str, int] | None) -> tuple[list[Hit] | None, list[int]]:
        """Hits, or (None, labels) when the caller should search those labels exactly."""
        with g.lock:
            live = len(g.file_of)
            if live == 0:
                return [], []
            if allowed is None:
                return self._knn(g, q, min(k, live), None), []
            keep = {f for f in allowed if f in g.by_file}
            n_allowed = sum(len(g.by_file[f]) for f in keep)
            if n_allowed == 0:
                return [], []
            want = min(k, n_allowed)
            fetch = min(live, max(k, math.ceil(k * live / n_allowed * 4)), self.max_overfetch)
            hits = self._knn(g, q, fetch, keep)
            if len(hits) >= want:
                return hits[:k], []
            labels = [label for f in keep for label in g.by_file[f]]
            if n_allowed <= self.exact_below:
                return None, labels
            # Many allowed chunks but too few survived the over-fetch: filter inside the graph walk.
            allowed_labels = set(labels)
            g.index.set_ef(max(self.ef_search, k))
            try:
                found, dist = g.index.knn_query(q, k=want, num_threads=1, filter=allowed_labels.__contains__)
            except RuntimeError:
                return None, labels
            return [(int(lb), 1.0 - float(d)) for lb, d in zip(found[0].tolist(), dist[0].tolist(),
                                                               strict=True)], []

    def _knn(self, g: _Graph, q: np.ndarray, fetch: int, keep: set[str] | None) -> list[Hit]:
        g.index.set_ef(max(self.ef_search, fetch))
        try:
            labels, dist = g.index.knn_query(q, k=fetch, num_threads=1)
        except RuntimeError:  # fewer reachable live elements than asked for
            return []
        out = []
        for label, d in zip(labels[0].tolist(), dist[0].tolist(), strict=True):
            f = g.file_of.get(int(label))
            if f is not None and (keep is None or f in keep):
                out.append((int(label), 1.0 - float(d)))
        return out

    def _save(self, store_id: str, g: _Graph) -> None:
        with g.lock:
            if not g.dirty or self._graphs.get(store_id) is not g:
                return
            tmp = self._path(store_id) + ".tmp"
            g.index.save_index(tmp)
            os.replace(tmp, self._path(store_id))
            g.dirty = False

    async def flush(self) -> None:
        """Write every changed graph now."""
        for store_id, g in list(self._graphs.items()):
            if g.dirty:
                await asyncio.to_thread(self._save, store_id, g)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await self.flush()
            except OSError:
                log.exception("index flush failed; will retry")

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await self.flush()

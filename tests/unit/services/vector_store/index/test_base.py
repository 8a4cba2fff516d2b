"""vector_store.index.base: the one interface — the four operations every backend must implement (a backend
missing one cannot be built), ``open``/``close`` optional, filters evaluated by the caller unless a backend says it
pushes them down; both real backends implement it with the right flag."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from embedmesh.services.vector_store.index.base import Hit, VectorIndex


class Flat(VectorIndex):
    """The smallest complete backend: exact search over a dict, honouring ``allowed``."""

    name = "flat"

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, tuple[str, np.ndarray]]] = {}

    async def added(self, store_id: str, file_id: str, ids: list[int], vectors: np.ndarray) -> None:
        for i, v in zip(ids, vectors, strict=True):
            self.rows.setdefault(store_id, {})[i] = (file_id, v)

    async def removed(self, store_id: str, ids: list[int]) -> None:
        for i in ids:
            self.rows.get(store_id, {}).pop(i, None)

    async def dropped(self, store_id: str) -> None:
        self.rows.pop(store_id, None)

    async def search(self, store_id: str, query: np.ndarray, k: int, flt: Any,
                     allowed: dict[str, int] | None) -> list[Hit]:
        scored = [(i, float(v @ query)) for i, (f, v) in self.rows.get(store_id, {}).items()
                  if allowed is None or f in allowed]
        return sorted(scored, key=lambda h: -h[1])[:k]


def test_a_backend_missing_an_operation_cannot_be_built() -> None:
    with pytest.raises(TypeError, match="abstract"):
        VectorIndex()  # type: ignore[abstract]

    class NoSearch(VectorIndex):
        async def added(self, *a: Any) -> None: ...
        async def removed(self, *a: Any) -> None: ...
        async def dropped(self, *a: Any) -> None: ...

    with pytest.raises(TypeError, match="search"):
        NoSearch()  # type: ignore[abstract]


async def test_open_and_close_are_optional_and_filters_are_the_callers_by_default() -> None:
    ix = Flat()
    assert not ix.pushes_down_filters
    await ix.open()
    await ix.added("s", "f1", [1, 2], np.eye(2, dtype=np.float32))
    await ix.added("s", "f2", [3], np.array([[0.9, 0.1]], np.float32))
    assert [h[0] for h in await ix.search("s", np.array([1, 0], np.float32), 2, None, None)] == [1, 3]
    assert [h[0] for h in await ix.search("s", np.array([1, 0], np.float32), 5, None, {"f2": 1})] == [3]
    await ix.removed("s", [1])
    await ix.dropped("other")
    assert [h[0] for h in await ix.search("s", np.array([1, 0], np.float32), 5, None, None)] == [3, 2]
    await ix.close()


def test_both_backends_implement_the_interface() -> None:
    from embedmesh.services.vector_store.index.embedded import EmbeddedIndex
    from embedmesh.services.vector_store.index.pgvector import PgVectorIndex

    assert issubclass(EmbeddedIndex, VectorIndex) and issubclass(PgVectorIndex, VectorIndex)
    assert (EmbeddedIndex.name, EmbeddedIndex.pushes_down_filters) == ("embedded", False)
    assert (PgVectorIndex.name, PgVectorIndex.pushes_down_filters) == ("pgvector", True)
    assert not EmbeddedIndex.__abstractmethods__ and not PgVectorIndex.__abstractmethods__

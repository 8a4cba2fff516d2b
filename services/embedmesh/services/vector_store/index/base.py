"""The one interface every index backend implements.

The chunk rows in the metadata store are the source of truth; an index answers "nearest chunk ids" for one store.
Backends that evaluate filters themselves (pgvector: SQL WHERE over jsonb) set ``pushes_down_filters``; for the
others the caller passes ``allowed``: the store's files that pass the filter, with their chunk counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from embedmesh.services.vector_store.filters import Filter

__all__ = ["VectorIndex", "Hit"]

Hit = tuple[int, float]
"""(chunk id, cosine similarity), best first."""


class VectorIndex(ABC):
    name: str = "base"
    pushes_down_filters: bool = False

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Load or create what the backend keeps (called once before serving)."""

    @abstractmethod
    async def added(self, store_id: str, file_id: str, ids: list[int], vectors: np.ndarray) -> None:
        """Chunks just committed for ``file_id`` (unit vectors, row i for ids[i])."""

    @abstractmethod
    async def removed(self, store_id: str, ids: list[int]) -> None:
        """Chunks just deleted."""

    @abstractmethod
    async def dropped(self, store_id: str) -> None:
        """The store was deleted."""

    @abstractmethod
    async def search(self, store_id: str, query: np.ndarray, k: int, flt: Filter | None,
                     allowed: dict[str, int] | None) -> list[Hit]:
        """Up to ``k`` nearest chunks to the unit vector ``query``. With a filter, only chunks of files that pass:
        ``flt`` for backends that push filters down, ``allowed`` (file id -> chunk count) for the others."""

    def search_now(self, store_id: str, query: np.ndarray, k: int) -> list[Hit] | None:
        """``search`` without a filter, run in the calling thread, when the backend can answer without I/O or
        loading anything (an index already in memory); None when it cannot (then ``search`` it). Thread-safe."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Persist and release."""

"""Approximate KV tracking for engines that publish no KV events (the ``hf`` worker).

The router assumes the worker it picked now caches the prompt's blocks, and forgets each block ``ttl_seconds``
after it was last routed there, or sooner when the worker's tracked blocks exceed ``max_blocks`` (oldest first) —
the way SGLang's router keeps an approximate tree with time-based eviction. The guesses go into the same
``RadixIndexer`` as event-fed blocks, so scoring treats both kinds of worker alike.

Per worker, an insertion-ordered dict ``hash -> expiry`` kept in touch order: the TTL is one constant, so the first
entry always expires first and ``expire`` pops from the front only (amortised O(expired blocks)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from embedmesh.services.router.indexer import RadixIndexer

__all__ = ["ApproxTracker"]


class ApproxTracker:
    """The router's own record of what it sent where, aged out over time."""

    def __init__(self, index: RadixIndexer, ttl_seconds: float = 120.0, max_blocks: int = 100_000) -> None:
        if ttl_seconds <= 0 or max_blocks < 1:
            raise ValueError("ttl_seconds must be > 0 and max_blocks >= 1")
        self.index = index
        self.ttl_seconds = ttl_seconds
        self.max_blocks = max_blocks
        self._by_worker: dict[str, OrderedDict[int, float]] = {}

    def routed(self, worker: str, hashes: Sequence[int], now: float) -> None:
        """``worker`` was sent a prompt with these blocks: assume it caches them until ``now + ttl``."""
        if not hashes:
            return
        blocks = self._by_worker.setdefault(worker, OrderedDict())
        expiry = now + self.ttl_seconds
        fresh = []
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)  # touch order: least recently routed first
            else:
                fresh.append(h)
            blocks[h] = expiry
        if fresh:
            self.index.stored(worker, 0, fresh)
        if len(blocks) > self.max_blocks:
            evicted = [blocks.popitem(last=False)[0] for _ in range(len(blocks) - self.max_blocks)]
            self.index.removed(worker, evicted)

    def expire(self, now: float) -> int:
        """Forget every block whose TTL passed; returns how many."""
        total = 0
        for worker, blocks in self._by_worker.items():
            gone = []
            while blocks:
                h, expiry = next(iter(blocks.items()))
                if expiry > now:
                    break
                blocks.popitem(last=False)
                gone.append(h)
            if gone:
                self.index.removed(worker, gone)
                total += len(gone)
        return total

    def forget(self, worker: str) -> None:
        """The worker left (its index entries are removed by the caller with the worker)."""
        self._by_worker.pop(worker, None)

    def tracked(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

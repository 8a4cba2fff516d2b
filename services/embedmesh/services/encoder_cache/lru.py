"""L1: an LRU bounded in bytes, with per-entry expiry.

Invariants: LRU order is the dict order, most recent at the end; ``current_bytes`` is the sum of stored sizes;
an entry larger than the whole capacity is refused without evicting anything; overwriting a key replaces its
size; a hit moves the entry to the end.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["ByteLRU", "TierCounters"]

V = TypeVar("V")


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ByteLRU(Generic[V]):
    """Not thread-safe: used from one event loop."""

    def __init__(self, capacity_bytes: int, clock: type[time.monotonic] | None = None) -> None:  # type: ignore[valid-type]
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.current_bytes = 0
        self.counters = TierCounters()
        self._items: OrderedDict[str, tuple[V, int, float]] = OrderedDict()
        self._clock = clock or time.monotonic

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        item = self._items.get(key)
        return item is not None and item[2] > self._clock()

    def put(self, key: str, value: V, size: int, ttl_seconds: float = float("inf")) -> bool:
        """Store; False (and nothing evicted) when ``size`` exceeds the capacity."""
        if size > self.capacity_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.current_bytes -= old[1]
        while self.current_bytes + size > self.capacity_bytes and self._items:
            _, (_, evicted, _) = self._items.popitem(last=False)
            self.current_bytes -= evicted
            self.counters.evictions += 1
        self._items[key] = (value, size, self._clock() + ttl_seconds)
        self.current_bytes += size
        return True

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None or item[2] <= self._clock():
            if item is not None:
                self.delete(key)
            self.counters.misses += 1
            return None
        self._items.move_to_end(key)
        self.counters.hits += 1
        return item[0]

    def delete(self, key: str) -> bool:
        item = self._items.pop(key, None)
        if item is None:
            return False
        self.current_bytes -= item[1]
        return True

    def keys(self) -> list[str]:
        """Least recent first."""
        return list(self._items)

    @property
    def utilization(self) -> float:
        return self.current_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

"""The hf engine's prefix cache: KV blocks of earlier prompts kept after their request ended, reused by a later
prompt that starts with the same blocks, so only the uncached suffix is prefilled.

Blocks are ``block_size`` positions (the worker's ``--block-size``, the one the router hashes with) and are named by
the mesh's chained block hashes (``core.block_hash``): token ids and ``prompt_embeds`` rows hashed by content, a
resumed stream's tokens after its prompt, and the chain re-keyed by the LoRA adapter's name (``adapter_block_hashes``)
so a prefix computed under one adapter is never reused by another or by the base model. A chained hash names a whole
prefix, so a block found by hash holds exactly the keys and values that prefix computes at those positions.

Each block is a copy of its keys and values (one tensor ``(layers, 2, kv_heads, block_size, head_dim)``, on the
model's device, in its dtype): no running sequence holds it, so any block can be evicted at any time. The cache keeps
at most ``capacity`` blocks and evicts the least recently used first; a lookup touches a chain tail first, so a
prefix's head outlives its tail (a tail without its head can never be found). Every change is published as the
mesh's KV events (``Stored`` in chain runs, ``Removed``, ``Cleared``) to ``sink``, like the mocker's simulated cache
and the vLLM translator, so the router indexes an hf worker by what it really holds.

Thread-safe: the engine thread looks up and stores, the event loop clears, drops an adapter's blocks and answers a
router's re-sync (``snapshot``); one lock orders them, and events reach ``sink`` in the order the changes were made.
The tensor work (gathering a past, cutting blocks out of a batch's cache) is in ``kv_blocks.py``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from embedmesh.core.block_hash import ROOT, adapter_block_hashes, block_hashes
from embedmesh.core.kv_events import Cleared, KvEvent, Removed, stored_runs
from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment

__all__ = ["PrefixCache", "PrefixCacheCollector", "request_hashes"]

Sink = Callable[[list[KvEvent]], None]


@dataclass
class _Entry:
    parent: int
    data: Any
    """The block's keys and values (opaque here)."""
    adapter: str
    nbytes: int


def request_hashes(request: GenerationRequest, block_size: int, generated: Sequence[int] = ()) -> list[int]:
    """The chained hashes of every full block of a request's positions: its prompt (token ids and embedding rows,
    hashed as received), then its resumed tokens and ``generated``, under its adapter's key. The same chain the
    preprocessor computes for the prompt and the mocker for its blocks."""
    pieces: list[Any] = [s.ids if isinstance(s, TokenSegment) else s.rows for s in request.segments]
    tail = tuple(request.resumed) + tuple(generated)
    if tail:
        pieces.append(tail)
    return adapter_block_hashes(block_hashes(pieces, block_size), request.lora_adapter)


class PrefixCache:
    """At most ``capacity`` blocks (0 = off: nothing is looked up or stored); ``sink`` gets each batch of events."""

    def __init__(self, capacity: int, block_size: int, sink: Sink | None = None) -> None:
        if capacity < 0 or block_size < 1:
            raise ValueError("capacity must be >= 0 and block_size >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self.sink = sink
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, _Entry] = OrderedDict()
        """Every block held, least recently used first."""
        self.nbytes = 0
        self.counters = {"lookup_tokens": 0, "hit_tokens": 0, "stored_blocks": 0, "removed_blocks": 0,
                         "cleared": 0}

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lookup(self, hashes: Sequence[int], limit: int, positions: int) -> list[Any]:
        """The data of the leading blocks of ``hashes`` held now, at most ``limit`` of them (the chain stops at the
        first one missing); they become the most recently used, head last. ``positions``: the prompt's length,
        counted as looked up."""
        with self._lock:
            found: list[int] = []
            for h in hashes[:max(limit, 0)]:
                if h not in self._blocks:
                    break
                found.append(h)
            for h in reversed(found):
                self._blocks.move_to_end(h)
            self.counters["lookup_tokens"] += positions
            self.counters["hit_tokens"] += len(found) * self.block_size
            return [self._blocks[h].data for h in found]

    def store(self, hashes: Sequence[int], start: int, blocks: Sequence[Any], adapter: str = "",
              nbytes: int = 0) -> None:
        """Keep ``blocks`` as ``hashes[start:start + len(blocks)]`` (each chained to the hash before it). A hash
        already held keeps its data and is only touched. Publishes the new blocks as stored runs, then evicts the
        least recently used blocks past the capacity (published as removed)."""
        if not self.enabled:
            return
        with self._lock:
            fresh: list[tuple[int, int]] = []
            for k, data in enumerate(blocks):
                i = start + k
                h = hashes[i]
                if h in self._blocks:
                    continue
                parent = hashes[i - 1] if i > 0 else ROOT
                self._blocks[h] = _Entry(parent, data, adapter, nbytes)
                self.nbytes += nbytes
                fresh.append((parent, h))
            # The whole chain up to the last block becomes the most recent, its head last (evicted last).
            for h in reversed(hashes[:start + len(blocks)]):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
            gone = []
            while len(self._blocks) > self.capacity:
                h, e = self._blocks.popitem(last=False)
                self.nbytes -= e.nbytes
                gone.append(h)
            # A block stored and evicted in this one call (a prompt longer than the whole cache) is never published.
            dropped, born = set(gone), {h for _, h in fresh}
            fresh = [(p, h) for p, h in fresh if h not in dropped]
            gone = [h for h in gone if h not in born]
            self.counters["stored_blocks"] += len(fresh)
            self._remove_count(len(gone))
            events: list[KvEvent] = list(stored_runs(fresh))
            if gone:
                events.append(Removed(tuple(gone)))
            self._emit(events)

    def drop_adapter(self, adapter: str) -> int:
        """Remove every block computed under ``adapter`` (it is being unloaded: a later adapter of that name may
        hold other weights); returns how many."""
        with self._lock:
            gone = [h for h, e in self._blocks.items() if e.adapter == adapter]
            for h in gone:
                self.nbytes -= self._blocks.pop(h).nbytes
            self._remove_count(len(gone))
            if gone:
                self._emit([Removed(tuple(gone))])
            return len(gone)

    def clear(self) -> bool:
        """Drop every block and publish ``Cleared`` (always possible: no running sequence holds a block)."""
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0
            self.counters["cleared"] += 1
            self._emit([Cleared()])
            return True

    def snapshot(self) -> list[KvEvent]:
        """Every block held, as stored runs, each parent before its children (a router's re-sync)."""
        with self._lock:
            parents = {h: e.parent for h, e in self._blocks.items()}
        children: dict[int, list[int]] = {}
        for h, parent in parents.items():
            children.setdefault(parent if parent in parents else ROOT, []).append(h)
        order: list[tuple[int, int]] = []
        stack = [ROOT]
        while stack:  # depth first from the root: a child always follows its parent
            for h in reversed(children.get(stack.pop(), ())):
                order.append((parents[h], h))
                stack.append(h)
        return list(stored_runs(order))

    def _remove_count(self, n: int) -> None:
        self.counters["removed_blocks"] += n

    def _emit(self, events: list[KvEvent]) -> None:
        if events and self.sink is not None:
            self.sink(events)


class PrefixCacheCollector:
    """The prefix cache's figures for Prometheus, read at scrape time: prompt positions looked up and found, blocks
    stored and removed (counters); blocks and bytes held (gauges)."""

    def __init__(self, cache: PrefixCache, worker_id: str) -> None:
        self.cache = cache
        self.worker_id = worker_id

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c, wid = self.cache, self.worker_id
        for name, doc, value in (
            ("embedmesh_hf_prefix_lookup_tokens", "Prompt positions looked up in the hf prefix cache",
             c.counters["lookup_tokens"]),
            ("embedmesh_hf_prefix_hit_tokens", "Prompt positions found in the hf prefix cache (not prefilled)",
             c.counters["hit_tokens"]),
            ("embedmesh_hf_prefix_stored_blocks", "KV blocks stored (published as stored)",
             c.counters["stored_blocks"]),
            ("embedmesh_hf_prefix_removed_blocks", "KV blocks evicted or dropped (published as removed)",
             c.counters["removed_blocks"]),
        ):
            m = CounterMetricFamily(name, doc, labels=["worker_id"])
            m.add_metric([wid], value)
            yield m
        for name, doc, value in (
            ("embedmesh_hf_prefix_blocks", "KV blocks the hf prefix cache holds", len(c)),
            ("embedmesh_hf_prefix_bytes", "Bytes of KV the hf prefix cache holds", c.nbytes),
        ):
            g = GaugeMetricFamily(name, doc, labels=["worker_id"])
            g.add_metric([wid], value)
            yield g

"""A simulated paged KV cache: a fixed number of blocks, prefix reuse by chained block hash, LRU eviction, and the
KV events a real engine would publish (the mesh's ``Stored`` / ``Removed`` / ``Cleared``, in the mesh's block
hashes, so the router indexes them exactly as it indexes the vLLM worker's translated events).

Physical blocks are in one of three states:

    free        holding nothing
    in use      held by at least one running sequence: hashed (a full, computed block, shareable) or anonymous
                (a partial tail, or decode room not yet filled)
    cached      hashed, no sequence holds it: reusable by a later prompt with the same prefix, evictable

A sequence reserves every block it will need when it is admitted (prompt + max_tokens; no preemption): the
blocks of its cached prefix are shared, the rest are taken from the free blocks, evicting cached ones least
recently used first. Its prompt blocks are published as stored when its prefill is done (``commit_prefill``), the
blocks its generated tokens filled when it finishes (``release``). A released sequence's blocks become cached tail
first, so the tail of a prefix is evicted before its head (vLLM frees a request's blocks in that order too).

Pure bookkeeping, no I/O, single-threaded (the engine calls it from its event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from embedmesh.core.block_hash import ROOT
from embedmesh.core.kv_events import Cleared, KvEvent, Removed, Stored

__all__ = ["Allocation", "PagedKvCache"]

Sink = Callable[[list[KvEvent]], None]


@dataclass
class _Block:
    parent: int
    refs: int = 0


@dataclass
class Allocation:
    """The blocks one sequence holds: hashed ones (shared, by hash) and anonymous ones (its own)."""

    hashes: list[int]
    """The prompt's full blocks' hashes (the adapter's chain under a LoRA adapter)."""
    hit: int
    """Leading blocks of ``hashes`` found cached at admission."""
    held: list[int] = field(default_factory=list)
    """Hashed blocks this sequence holds a reference on, in chain order."""
    anonymous: int = 0
    """Blocks it holds that carry no hash (yet)."""
    committed: bool = False


class PagedKvCache:
    """The simulated cache; ``sink`` receives each batch of KV events (never an empty one)."""

    def __init__(self, num_blocks: int, block_size: int, sink: Sink | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sink = sink
        self._blocks: dict[int, _Block] = {}
        """Every hashed block, in use or cached."""
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Cached blocks (hashed, no references). LRU order: least recently used first."""
        self._anonymous = 0
        self.counters = {"stored_blocks": 0, "removed_blocks": 0, "cleared": 0}

    # --- reading ---------------------------------------------------------------------------------------------
    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` held now (in use or cached): the chain stops at the first one missing."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - len(self._blocks) - self._anonymous

    @property
    def cached_blocks(self) -> int:
        """Hashed blocks no sequence holds (evictable)."""
        return len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running sequences."""
        return len(self._blocks) - len(self._lru) + self._anonymous

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    # --- a sequence's life -----------------------------------------------------------------------------------
    def allocate(self, hashes: Sequence[int], total_blocks: int) -> Allocation | None:
        """Reserve ``total_blocks`` blocks for a sequence whose prompt has these full blocks: its cached prefix is
        shared, the rest taken from free blocks and, when those run out, from the least recently used cached ones.
        None (and nothing changed) when the cache cannot hold it now."""
        hashes = list(hashes)
        total_blocks = max(total_blocks, len(hashes))
        hit = self.cached_prefix(hashes)
        reused = hashes[:hit]
        evictable = len(self._lru) - sum(1 for h in reused if self._blocks[h].refs == 0)
        need = total_blocks - hit
        if self.free_blocks + evictable < need:
            return None
        alloc = Allocation(hashes, hit)
        for h in reused:
            self._ref(h)
            alloc.held.append(h)
        self._evict(need - self.free_blocks)
        self._anonymous += need
        alloc.anonymous = need
        return alloc

    def commit_prefill(self, alloc: Allocation) -> None:
        """The sequence's prompt is computed: its full blocks beyond the cached prefix become shareable (stored)."""
        if alloc.committed:
            return
        alloc.committed = True
        self._store(alloc, alloc.hashes, alloc.hit)

    def release(self, alloc: Allocation, full_hashes: Sequence[int] = ()) -> None:
        """The sequence ended. ``full_hashes``: the hashes of every full block of prompt + generated tokens (a
        finished sequence's; empty for an aborted one): blocks its generation filled are stored first. Its hashed
        blocks become cached, tail first; its anonymous blocks are freed."""
        if alloc.committed and len(full_hashes) > len(alloc.held):
            self._store(alloc, full_hashes, len(alloc.held))
        for h in reversed(alloc.held):
            b = self._blocks[h]
            b.refs -= 1
            if b.refs == 0:
                self._lru[h] = None  # most recent at the end; the head of the chain ends up the most recent
        alloc.held.clear()
        self._anonymous -= alloc.anonymous
        alloc.anonymous = 0

    def clear(self) -> bool:
        """Drop every cached block and publish ``Cleared``; False (nothing done) while any block is in use, as
        vLLM's prefix-cache reset refuses then."""
        if self.used_blocks:
            return False
        self._blocks.clear()
        self._lru.clear()
        self.counters["cleared"] += 1
        self._emit([Cleared()])
        return True

    def snapshot(self) -> list[KvEvent]:
        """Every hashed block as stored events, parents before children (answers a router's re-sync)."""
        out: list[tuple[int, list[int]]] = []
        placed: set[int] = set()
        pending = list(self._blocks.items())
        # Chains are short; place blocks whose parent is the root or already placed, round by round.
        while pending:
            rest = []
            for h, b in pending:
                if b.parent == ROOT or b.parent in placed or b.parent not in self._blocks:
                    if out and out[-1][1][-1] == b.parent:
                        out[-1][1].append(h)
                    else:
                        out.append((b.parent, [h]))
                    placed.add(h)
                else:
                    rest.append((h, b))
            pending = rest
        return [Stored(parent, tuple(hs)) for parent, hs in out]

    # --- internals -------------------------------------------------------------------------------------------
    def _ref(self, h: int) -> None:
        b = self._blocks[h]
        if b.refs == 0:
            del self._lru[h]
        b.refs += 1

    def _store(self, alloc: Allocation, hashes: Sequence[int], start: int) -> None:
        """Turn the sequence's anonymous blocks into hashed ones for ``hashes[start:]`` (a hash another sequence
        stored meanwhile is shared instead and the duplicate freed) and publish the new ones as stored runs."""
        fresh: list[tuple[int, int]] = []
        for i in range(start, len(hashes)):
            h = hashes[i]
            parent = hashes[i - 1] if i > 0 else ROOT
            if alloc.anonymous < 1:
                break
            alloc.anonymous -= 1
            self._anonymous -= 1
            if h in self._blocks:
                self._ref(h)
            else:
                self._blocks[h] = _Block(parent, 1)
                fresh.append((parent, h))
                self.counters["stored_blocks"] += 1
            alloc.held.append(h)
        runs: list[tuple[int, list[int]]] = []
        for parent, h in fresh:
            if runs and runs[-1][1][-1] == parent:
                runs[-1][1].append(h)
            else:
                runs.append((parent, [h]))
        if runs:
            self._emit([Stored(parent, tuple(hs)) for parent, hs in runs])

    def _evict(self, count: int) -> None:
        gone = []
        for _ in range(max(count, 0)):
            h, _ = self._lru.popitem(last=False)
            del self._blocks[h]
            gone.append(h)
        if gone:
            self.counters["removed_blocks"] += len(gone)
            self._emit([Removed(tuple(gone))])

    def _emit(self, events: list[KvEvent]) -> None:
        if self.sink is not None:
            self.sink(events)

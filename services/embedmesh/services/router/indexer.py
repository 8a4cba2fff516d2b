"""The KV index: which workers hold which blocks, as a radix tree over chained block hashes.

A chained block hash names a block *and its whole prefix* (``embedmesh.core.block_hash``), so the radix tree needs
no child maps: a node is identified by its hash, and "the child of node P along block h" is simply node h. The tree
is therefore stored flat, as one dict ``hash -> worker bitmask`` (the node table), plus one set of hashes per
worker (the per-worker sets, for removals, clears and leaving workers). That is the layout that is fast in Python:

- ``stored`` / ``removed``: one dict operation and one set operation per block.
- ``find_matches``: walks the prompt's hashes from the root, AND-ing the bitmasks of the workers still matching;
  a worker leaves the walk at the first block it lacks (its score is the depth there) and the walk stops as soon
  as no worker is left (early exit).

Workers are numbered with small slots (bit ``1 << slot``); a leaving worker's slot is reused. A bitmask is a
Python int, so any number of workers works, and 64 of them fit in a 36-byte int.

Invariants: ``_nodes[h]`` has bit ``s`` set iff ``h in _held[s]``; a node exists iff its mask is non-zero
(no empty nodes are kept); ``_names[s]`` is the worker in slot ``s`` (None when free).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["RadixIndexer"]


class RadixIndexer:
    """Radix index of KV blocks per worker; every method is O(blocks touched)."""

    __slots__ = ("_nodes", "_held", "_slots", "_names", "_free")

    def __init__(self) -> None:
        self._nodes: dict[int, int] = {}
        """Node table: chained block hash -> bitmask of worker slots holding that block."""
        self._held: list[set[int]] = []
        """Per-worker sets, by slot."""
        self._slots: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []

    # --- workers --------------------------------------------------------------------------------------------
    def _slot(self, worker: str) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._names[slot] = worker
            else:
                slot = len(self._names)
                self._names.append(worker)
                self._held.append(set())
            self._slots[worker] = slot
        return slot

    def remove_worker(self, worker: str) -> None:
        """Forget a worker entirely (it left): its blocks, and its slot for reuse."""
        slot = self._slots.pop(worker, None)
        if slot is None:
            return
        self._clear_slot(slot)
        self._names[slot] = None
        self._free.append(slot)

    @property
    def workers(self) -> list[str]:
        return sorted(self._slots)

    # --- events ---------------------------------------------------------------------------------------------
    def stored(self, worker: str, parent_hash: int, block_hashes: Iterable[int]) -> None:
        """``worker`` cached these consecutive blocks after ``parent_hash`` (0 = prompt start).

        The parent is implied by the chained hashes and not needed to place the blocks; a block whose parent the
        index does not hold (evicted, or events reordered) is still indexed, and a lookup only counts it when every
        block before it matches too.
        """
        slot = self._slot(worker)
        bit = 1 << slot
        hashes = block_hashes if isinstance(block_hashes, list | tuple) else list(block_hashes)
        nodes = self._nodes
        get = nodes.get
        for h in hashes:
            m = get(h)
            if m is None:
                nodes[h] = bit  # one shared int object for every block only this worker holds
            elif not m & bit:
                nodes[h] = m | bit
        self._held[slot].update(hashes)

    def removed(self, worker: str, block_hashes: Iterable[int]) -> None:
        """``worker`` evicted these blocks (unknown ones are ignored: removal is idempotent)."""
        slot = self._slots.get(worker)
        if slot is None:
            return
        held = self._held[slot]
        keep = ~(1 << slot)
        nodes = self._nodes
        for h in block_hashes:
            if h in held:
                held.remove(h)
                m = nodes[h] & keep
                if m:
                    nodes[h] = m
                else:
                    del nodes[h]

    def cleared(self, worker: str) -> None:
        """``worker`` dropped every block (it keeps its slot: more events will follow)."""
        slot = self._slots.get(worker)
        if slot is not None:
            self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> None:
        keep = ~(1 << slot)
        nodes = self._nodes
        for h in self._held[slot]:
            m = nodes[h] & keep
            if m:
                nodes[h] = m
            else:
                del nodes[h]
        self._held[slot] = set()

    # --- lookups --------------------------------------------------------------------------------------------
    def find_matches(self, block_hashes: Iterable[int]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it holds (workers with 0 are absent)."""
        get = self._nodes.get
        it = iter(block_hashes)
        first = next(it, None)
        if first is None:
            return {}
        active = get(first, 0)
        if not active:
            return {}
        out: dict[str, int] = {}
        depth = 1
        for h in it:
            m = get(h, 0) & active
            if m != active:
                self._credit(out, active ^ m, depth)
                if not m:
                    return out
                active = m
            depth += 1
        self._credit(out, active, depth)
        return out

    def _credit(self, out: dict[str, int], mask: int, depth: int) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            out[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            mask ^= low

    def holds(self, worker: str, block_hash: int) -> bool:
        slot = self._slots.get(worker)
        return slot is not None and block_hash in self._held[slot]

    def blocks_of(self, worker: str) -> int:
        """Blocks indexed for ``worker``."""
        slot = self._slots.get(worker)
        return 0 if slot is None else len(self._held[slot])

    @property
    def node_count(self) -> int:
        """Distinct blocks (nodes of the tree)."""
        return len(self._nodes)

    @property
    def worker_block_count(self) -> int:
        """(worker, block) pairs."""
        return sum(len(self._held[s]) for s in self._slots.values())

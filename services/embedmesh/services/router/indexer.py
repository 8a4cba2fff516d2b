"""A radix tree over chained block hashes, with the set of workers holding each block.

Because a block hash chains its parent, one hash names one prefix: the tree is a dict from hash to node plus
parent/child links, so ``stored`` attaches under the parent in O(blocks) and ``find_matches`` walks children from
the root, narrowing the set of workers that still match and stopping as soon as none does (early exit).

Invariants: a node exists while some worker holds it or it has children; ``_by_worker[w]`` is exactly the set of
hashes whose node lists ``w``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["RadixIndexer"]


class _Node:
    __slots__ = ("hash", "parent", "children", "workers")

    def __init__(self, h: int, parent: _Node | None) -> None:
        self.hash = h
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.workers: set[str] = set()


class RadixIndexer:
    def __init__(self) -> None:
        self._root = _Node(0, None)
        self._nodes: dict[int, _Node] = {}
        self._by_worker: dict[str, set[int]] = {}

    # --- events ---------------------------------------------------------------------------------------------
    def stored(self, worker: str, parent_hash: int, block_hashes: Iterable[int]) -> None:
        """``worker`` cached these consecutive blocks after ``parent_hash`` (0 = prompt start)."""
        parent = self._root if parent_hash == 0 else self._nodes.get(parent_hash)
        if parent is None:
            # Parent unknown (evicted, or events out of order): attach under the root so the blocks still count for
            # lookups that reach them; a later stored event with the parent re-links nothing, which is harmless.
            parent = self._root
        held = self._by_worker.setdefault(worker, set())
        for h in block_hashes:
            node = self._nodes.get(h)
            if node is None:
                node = _Node(h, parent)
                parent.children[h] = node
                self._nodes[h] = node
            node.workers.add(worker)
            held.add(h)
            parent = node

    def removed(self, worker: str, block_hashes: Iterable[int]) -> None:
        held = self._by_worker.get(worker)
        if not held:
            return
        for h in block_hashes:
            if h in held:
                held.discard(h)
                node = self._nodes.get(h)
                if node is not None:
                    node.workers.discard(worker)
                    self._prune(node)

    def cleared(self, worker: str) -> None:
        """The worker dropped every block (also used when a worker leaves)."""
        held = self._by_worker.pop(worker, set())
        for h in held:
            node = self._nodes.get(h)
            if node is not None:
                node.workers.discard(worker)
        for h in held:
            node = self._nodes.get(h)
            if node is not None:
                self._prune(node)

    remove_worker = cleared

    def _prune(self, node: _Node) -> None:
        while node is not self._root and not node.workers and not node.children and node.parent is not None:
            del node.parent.children[node.hash]
            del self._nodes[node.hash]
            node = node.parent

    # --- lookups --------------------------------------------------------------------------------------------
    def find_matches(self, block_hashes: Iterable[int]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it holds (workers with 0 are absent)."""
        scores: dict[str, int] = {}
        node = self._root
        active: set[str] | None = None
        depth = 0
        for h in block_hashes:
            # A block stored before its parent was known hangs under the root; chained hashes make the global
            # lookup equivalent to following the child link.
            child = node.children.get(h) or self._nodes.get(h)
            if child is None:
                break
            active = set(child.workers) if active is None else active & child.workers
            if not active:
                break
            depth += 1
            for w in active:
                scores[w] = depth
            node = child
        return scores

    def blocks_of(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    @property
    def worker_block_count(self) -> int:
        return sum(len(v) for v in self._by_worker.values())

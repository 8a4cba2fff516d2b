"""KV cache events in the mesh's terms, shared by whoever produces them (a worker's engine, e.g. the vLLM
translator) and the router that indexes them, plus their router-protocol messages.

Blocks are named by the mesh's chained block hashes (``core.block_hash``), never an engine's own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embedmesh.router.v1 import router_pb2

__all__ = ["Stored", "Removed", "Cleared", "KvEvent", "stored_runs", "to_proto"]


@dataclass(frozen=True)
class Stored:
    """Blocks cached, chained under ``parent_hash`` (``block_hash.ROOT`` = 0 for a prompt's first block)."""

    parent_hash: int
    block_hashes: Sequence[int]


@dataclass(frozen=True)
class Removed:
    """Blocks evicted."""

    block_hashes: Sequence[int]


@dataclass(frozen=True)
class Cleared:
    """Every block dropped (the engine's cache was reset, or the producer lost track of it)."""


KvEvent = Stored | Removed | Cleared


def stored_runs(pairs: Sequence[tuple[int, int]]) -> list[Stored]:
    """(parent, hash) pairs of newly stored blocks, in order, as few ``Stored`` events as chain: consecutive pairs
    whose parent is the block before join one event."""
    runs: list[tuple[int, list[int]]] = []
    for parent, h in pairs:
        if runs and runs[-1][1][-1] == parent:
            runs[-1][1].append(h)
        else:
            runs.append((parent, [h]))
    return [Stored(parent, tuple(hs)) for parent, hs in runs]


def to_proto(events: Sequence[KvEvent]) -> list[router_pb2.KvEvent]:
    """The router protocol's ``KvEvent`` messages for these events (``WorkerStream`` batches)."""
    out = []
    for e in events:
        if isinstance(e, Stored):
            out.append(router_pb2.KvEvent(stored=router_pb2.BlocksStored(parent_hash=e.parent_hash,
                                                                         block_hashes=e.block_hashes)))
        elif isinstance(e, Removed):
            out.append(router_pb2.KvEvent(removed=router_pb2.BlocksRemoved(block_hashes=e.block_hashes)))
        else:
            out.append(router_pb2.KvEvent(cleared=router_pb2.AllBlocksCleared()))
    return out

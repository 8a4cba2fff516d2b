"""Live workers: registration, load, KV event batches with gap detection, liveness, and approximate tracking.

A worker is dropped (and its blocks leave the index) when its stream ends or when it has been silent for longer
than ``stale_seconds``. Event batches carry the worker's event ids 1, 2, 3, ...: a batch whose id is not the
previous + 1 means events were lost, so the worker is asked for a snapshot and batches are ignored until it
arrives. Workers that publish no KV events are tracked approximately (``approx.ApproxTracker``).

Domain types only; the servicer converts protobuf to these.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from embedmesh.core.kv_events import Cleared, KvEvent, Removed, Stored
from embedmesh.services.router.approx import ApproxTracker
from embedmesh.services.router.indexer import RadixIndexer

__all__ = ["Stored", "Removed", "Cleared", "KvEvent", "EventBatch", "BatchOutcome", "WorkerState", "Registry"]


@dataclass(frozen=True)
class EventBatch:
    event_id: int
    events: Sequence[KvEvent]
    snapshot: bool = False
    """A full snapshot (the answer to a re-sync): replaces what the index held for the worker."""


class BatchOutcome(Enum):
    APPLIED = "applied"
    GAP = "gap"
    """Ids skipped: the caller asks the worker for a re-sync."""
    AWAITING_SNAPSHOT = "awaiting_snapshot"
    """Ignored: a re-sync was asked and the snapshot has not come yet."""


@dataclass
class WorkerState:
    worker_id: str
    address: str
    model: str
    block_size: int
    engine: str
    publishes_kv_events: bool
    active_requests: int = 0
    kv_usage: float = 0.0
    routed_since_load: int = 0
    """Requests routed here since the last heartbeat (the heartbeat's count does not include them yet)."""
    last_event_id: int = 0
    awaiting_snapshot: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    session: int = 0
    """Increments on every (re-)registration, so a stale stream's cleanup cannot drop a newer one."""
    adapters: frozenset[str] = frozenset()
    """LoRA adapters it reported in its last heartbeat."""

    @property
    def load(self) -> int:
        return self.active_requests + self.routed_since_load


class Registry:
    """Workers by id, the KV index they feed, and the approximate tracker for workers without events."""

    def __init__(self, stale_seconds: float = 3.0, approx_ttl_seconds: float = 120.0,
                 approx_max_blocks: int = 100_000) -> None:
        self.workers: dict[str, WorkerState] = {}
        self.index = RadixIndexer()
        self.approx = ApproxTracker(self.index, approx_ttl_seconds, approx_max_blocks)
        self.stale_seconds = stale_seconds
        self._sessions = 0

    def register(self, state: WorkerState) -> WorkerState:
        """Add a worker; one already registered under the id (an earlier stream of it) is replaced."""
        if state.worker_id in self.workers:
            self.drop(state.worker_id)
        self._sessions += 1
        state.session = self._sessions
        state.last_seen = time.monotonic()
        self.workers[state.worker_id] = state
        return state

    def drop(self, worker_id: str, session: int | None = None) -> bool:
        """Remove a worker and its blocks; with ``session``, only if that registration is still the live one."""
        w = self.workers.get(worker_id)
        if w is None or (session is not None and w.session != session):
            return False
        del self.workers[worker_id]
        self.index.remove_worker(worker_id)
        self.approx.forget(worker_id)
        return True

    def is_live(self, state: WorkerState) -> bool:
        return self.workers.get(state.worker_id) is state

    def sweep(self, now: float | None = None) -> list[str]:
        """Drop silent workers and forget expired approximate blocks; returns the dropped worker ids."""
        now = time.monotonic() if now is None else now
        dropped = [wid for wid, w in self.workers.items() if now - w.last_seen > self.stale_seconds]
        for wid in dropped:
            self.drop(wid)
        self.approx.expire(now)
        return dropped

    # --- worker messages ------------------------------------------------------------------------------------
    def heartbeat(self, state: WorkerState, active_requests: int, kv_usage: float,
                  adapters: frozenset[str] | None = None) -> None:
        state.active_requests = active_requests
        state.kv_usage = kv_usage
        if adapters is not None:
            state.adapters = adapters
        state.routed_since_load = 0
        state.last_seen = time.monotonic()

    def apply(self, state: WorkerState, batch: EventBatch) -> BatchOutcome:
        """Apply one event batch of ``state``'s worker, or report why not."""
        state.last_seen = time.monotonic()
        if batch.snapshot:
            self.index.cleared(state.worker_id)
            state.awaiting_snapshot = False
        elif state.awaiting_snapshot:
            return BatchOutcome.AWAITING_SNAPSHOT
        elif batch.event_id != state.last_event_id + 1:
            state.awaiting_snapshot = True
            return BatchOutcome.GAP
        index, wid = self.index, state.worker_id
        for ev in batch.events:
            if isinstance(ev, Stored):
                index.stored(wid, ev.parent_hash, ev.block_hashes)
            elif isinstance(ev, Removed):
                index.removed(wid, ev.block_hashes)
            else:
                index.cleared(wid)
        state.last_event_id = batch.event_id
        return BatchOutcome.APPLIED

    # --- routing --------------------------------------------------------------------------------------------
    def record_routed(self, worker_id: str, hashes: Sequence[int], now: float | None = None) -> None:
        """Count the request against the worker's load; for a worker without events, assume it now caches the
        prompt's blocks."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.routed_since_load += 1
        if not w.publishes_kv_events:
            self.approx.routed(worker_id, hashes, time.monotonic() if now is None else now)

    def candidates(self, model: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.model == model]

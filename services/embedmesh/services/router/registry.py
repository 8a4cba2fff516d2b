"""Live workers: registration, load, event ids, liveness; and the approximate index for workers without events.

A worker is dropped (and its blocks leave the index) when its stream ends or when it has been silent for longer
than ``stale_seconds``. Workers that publish no KV events are tracked from the router's own decisions: each routed
prompt's blocks are recorded for the chosen worker and forgotten after ``approx_ttl_seconds`` (SGLang's router
keeps the same kind of approximate tree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from embedmesh.services.router.indexer import RadixIndexer

__all__ = ["WorkerState", "Registry"]


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
    last_event_id: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    session: int = 0
    """Increments on every (re-)registration, so a stale stream's cleanup cannot drop a newer one."""

    @property
    def load(self) -> int:
        return self.active_requests + self.routed_since_load


class Registry:
    def __init__(self, stale_seconds: float = 3.0, approx_ttl_seconds: float = 120.0) -> None:
        self.workers: dict[str, WorkerState] = {}
        self.index = RadixIndexer()
        self.stale_seconds = stale_seconds
        self.approx_ttl_seconds = approx_ttl_seconds
        self._approx_expiry: dict[tuple[str, int], float] = {}
        self._sessions = 0

    def register(self, state: WorkerState) -> WorkerState:
        old = self.workers.get(state.worker_id)
        if old is not None:
            self.drop(old.worker_id)
        self._sessions += 1
        state.session = self._sessions
        self.workers[state.worker_id] = state
        return state

    def drop(self, worker_id: str, session: int | None = None) -> bool:
        w = self.workers.get(worker_id)
        if w is None or (session is not None and w.session != session):
            return False
        del self.workers[worker_id]
        self.index.remove_worker(worker_id)
        self._approx_expiry = {k: v for k, v in self._approx_expiry.items() if k[0] != worker_id}
        return True

    def sweep(self, now: float | None = None) -> list[str]:
        """Drop silent workers and forget expired approximate blocks; returns the dropped worker ids."""
        now = time.monotonic() if now is None else now
        dropped = [wid for wid, w in self.workers.items() if now - w.last_seen > self.stale_seconds]
        for wid in dropped:
            self.drop(wid)
        expired = [k for k, t in self._approx_expiry.items() if t <= now]
        for wid, h in expired:
            del self._approx_expiry[(wid, h)]
            self.index.removed(wid, [h])
        return dropped

    def record_routed(self, worker_id: str, hashes: list[int], now: float | None = None) -> None:
        """Approximate tracking: assume the chosen worker now caches the prompt's blocks."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.routed_since_load += 1
        if w.publishes_kv_events or not hashes:
            return
        self.index.stored(worker_id, 0, hashes)
        expiry = (time.monotonic() if now is None else now) + self.approx_ttl_seconds
        for h in hashes:
            self._approx_expiry[(worker_id, h)] = expiry

    def candidates(self, model: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.model == model]

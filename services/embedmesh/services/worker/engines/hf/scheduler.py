"""What the hf engine runs next: the inbox the event loop puts new sequences in, the sequences by request id, how
many the engine thread takes between two decode steps, and aborts applied before a sequence takes a step."""

from __future__ import annotations

import queue

from embedmesh.services.worker.engines.base import EngineStats, FinishReason, GenerationDelta
from embedmesh.services.worker.engines.hf.sequence import Seq

__all__ = ["Scheduler"]


class Scheduler:
    """The queue between the event loop (``put``) and the engine thread (``take``); ``None`` in the inbox stops
    the thread."""

    def __init__(self, stats: EngineStats) -> None:
        self.inbox: queue.Queue[Seq | None] = queue.Queue()
        self.by_id: dict[str, Seq] = {}
        """Every sequence a ``generate`` call holds, until that call ends."""
        self._stats = stats

    def take(self, block: bool, room: int) -> list[Seq] | None:
        """Up to ``room`` waiting sequences (waiting for the first when ``block``); None once stopped."""
        out: list[Seq] = []
        if room <= 0:
            return out
        try:
            first = self.inbox.get(block=block, timeout=None)
        except queue.Empty:
            return out
        if first is None:
            return None
        out.append(first)
        while len(out) < room:
            try:
                nxt = self.inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self.inbox.put(None)
                break
            out.append(nxt)
        return out

    def abort_if_needed(self, s: Seq) -> bool:
        """Whether ``s`` takes no more steps: ended already, or aborted (then ended here with an ABORT delta)."""
        if s.aborted and not s.done:
            s.done = True
            self._stats.aborted_requests += 1
            s.emit(GenerationDelta("", (), len(s.generated), FinishReason.ABORT))
            return True
        return s.done

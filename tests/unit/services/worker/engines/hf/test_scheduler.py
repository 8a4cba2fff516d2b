"""The scheduler takes at most ``room`` waiting sequences, keeps the stop mark for the next take, and ends an aborted
sequence with one ABORT delta."""

from __future__ import annotations

import asyncio

from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import EngineStats, FinishReason, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.hf.scheduler import Scheduler
from embedmesh.services.worker.engines.hf.sequence import Seq


def _seq(loop: asyncio.AbstractEventLoop, rid: str) -> Seq:
    return Seq(GenerationRequest(rid, [TokenSegment((1,))], SamplingParams()), asyncio.Queue(), loop, detok=None)


async def test_take_respects_room_and_the_stop_mark() -> None:
    loop = asyncio.get_running_loop()
    s = Scheduler(EngineStats())
    seqs = [_seq(loop, str(i)) for i in range(3)]
    for q in seqs:
        s.inbox.put(q)
    s.inbox.put(None)
    assert s.take(block=False, room=0) == []
    assert s.take(block=False, room=2) == seqs[:2]
    assert s.take(block=False, room=5) == seqs[2:]
    assert s.take(block=False, room=5) is None


async def test_an_aborted_sequence_ends_with_one_abort_delta() -> None:
    stats = EngineStats()
    s = Scheduler(stats)
    seq = _seq(asyncio.get_running_loop(), "a")
    assert not s.abort_if_needed(seq)
    seq.aborted = True
    assert s.abort_if_needed(seq) and s.abort_if_needed(seq)
    await asyncio.sleep(0)
    assert seq.out.get_nowait().finish_reason == FinishReason.ABORT and seq.out.empty()
    assert stats.aborted_requests == 1

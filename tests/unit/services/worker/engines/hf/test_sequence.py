"""A sequence ends with an error once: ours as is, anything else as INTERNAL without internals; a failed step fails
every sequence it ran."""

from __future__ import annotations

import asyncio

from embedmesh.core.errors import InternalError, InvalidArgument
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.hf.sequence import Seq, fail_step


def _seq(loop: asyncio.AbstractEventLoop, rid: str = "r") -> Seq:
    return Seq(GenerationRequest(rid, [TokenSegment((1,))], SamplingParams()), asyncio.Queue(), loop, detok=None)


async def test_a_sequence_fails_once_and_hides_internals() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = _seq(loop, "a"), _seq(loop, "b")
    ours.fail(InvalidArgument("prompt: bad", field="prompt"))
    ours.fail(RuntimeError("second"))
    fail_step([theirs], RuntimeError("kernel detail"), "decode")
    await asyncio.sleep(0)
    assert ours.done and ours.out.qsize() == 1 and isinstance(ours.out.get_nowait(), InvalidArgument)
    got = theirs.out.get_nowait()
    assert isinstance(got, InternalError) and "kernel" not in str(got)

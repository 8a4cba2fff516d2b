"""An engine's deltas, merged while the caller is slower than the engine.

The worker writes one gRPC message per delta it hands on. An engine can produce deltas faster than the stream
drains (a fast engine, a slow reader, or a busy event loop): ``coalesced`` runs the engine's stream in a task and
hands the caller, each time it asks, everything produced since — consecutive deltas merged into one (text and
token ids joined, log-probabilities joined, the last one's counts and finish reason). When the caller keeps up,
every delta goes out alone, as before; when it does not, the worker sends fewer, larger messages instead of
queueing without bound (the engine is paused once ``backlog`` deltas wait).

Closing the iterator (the caller went away) cancels the task, which closes the engine's stream: engines abort the
sequence there, exactly as when the servicer iterated the stream itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from embedmesh.services.worker.engines.base import GenerationDelta

__all__ = ["coalesced", "merge"]


def merge(deltas: list[GenerationDelta]) -> GenerationDelta:
    """One delta standing for ``deltas`` (consecutive, of one sequence)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return GenerationDelta(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        completion_tokens=last.completion_tokens,
        finish_reason=last.finish_reason,
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        prompt_logprobs=prompt,
    )


async def coalesced(stream: AsyncIterator[GenerationDelta], backlog: int = 256) -> AsyncIterator[GenerationDelta]:
    """``stream``'s deltas, merged when several are waiting (see the module docstring)."""
    pending: list[GenerationDelta] = []
    ready = asyncio.Event()
    drained = asyncio.Event()
    finished = False

    async def pump() -> None:
        nonlocal finished
        try:
            async for delta in stream:
                pending.append(delta)
                ready.set()
                if len(pending) >= backlog:
                    drained.clear()
                    await drained.wait()
        finally:
            finished = True
            ready.set()
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    task = asyncio.ensure_future(pump())
    try:
        while True:
            if not pending and not finished:
                await ready.wait()
                ready.clear()
            if pending:
                batch = pending[:]
                pending.clear()
                drained.set()
                yield merge(batch)
                continue
            if finished:
                await task  # the engine's error, if it ended with one
                return
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

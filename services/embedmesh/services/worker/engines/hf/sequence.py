"""One sequence as every part of the hf engine sees it: its request, where its output goes, its sampling state,
and how it ends with an error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from embedmesh.core.errors import EmbedmeshError, InternalError
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import GenerationDelta, GenerationRequest, TokenLogprob
from embedmesh.services.worker.engines.hf.detok import IncrementalDetokenizer

__all__ = ["Seq", "fail_step"]

log = get_logger(__name__)


@dataclass(eq=False)
class Seq:
    request: GenerationRequest
    out: asyncio.Queue[GenerationDelta | BaseException]
    loop: asyncio.AbstractEventLoop
    detok: IncrementalDetokenizer
    generator: Any = None
    generated: list[int] = field(default_factory=list)
    pending: int = -1
    position: int = 0
    aborted: bool = False
    done: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Parallel to ``generated`` when the request asked for log-probabilities."""
    prompt_lp: tuple[TokenLogprob, ...] | None = None
    """Prompt log-probabilities, sent with the first delta."""
    counts: dict[int, int] = field(default_factory=dict)
    """Generated token -> times (frequency/presence penalties)."""
    matcher: Any = None
    """The grammar matcher of a structured-output request (``core/structured.py``)."""
    cache_on: bool = False
    """The prefix cache was on when this sequence was admitted (only then does it store blocks)."""
    hashes: list[int] = field(default_factory=list)
    """The block hashes of the prompt and resumed tokens, when the prefix cache is on (``prefix_cache.py``)."""
    prompt_positions: int = 0
    """Positions prefilled as the prompt (its resumed tokens included)."""
    stored_blocks: int = 0
    """Leading full blocks of this sequence the prefix cache holds (found there, or stored from it)."""
    failed: bool = False
    """Ended by an error: its KV cache may hold anything, so none of it is stored."""

    def emit(self, item: GenerationDelta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def fail(self, e: Exception) -> None:
        """End the sequence with an error (ours as is; anything else without internals)."""
        if self.done:
            return
        self.done = True
        self.failed = True
        if not isinstance(e, EmbedmeshError):
            e = InternalError("the model failed while generating this request; it was logged on the worker")
        self.emit(e)


def fail_step(seqs: list[Seq], e: Exception, step: str) -> None:
    """A step (prefill, merge, decode) raised: every sequence it ran fails, and it is logged once."""
    log.exception("hf %s step failed; failing its %d sequences", step, len(seqs),
                  extra={"request_ids": [s.request.request_id for s in seqs]})
    for s in seqs:
        s.fail(e)

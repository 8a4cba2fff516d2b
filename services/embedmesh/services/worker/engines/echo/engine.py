"""A trivial engine for measuring the mesh's own overhead: no model, answers at once.

It generates ``max_tokens`` copies of one token whose text is "x", so what a benchmark measures is transport,
validation and scheduling — never matrix multiplies. Not for serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from embedmesh.services.worker.engines.base import (
    Engine,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
)

__all__ = ["EchoEngine"]


class EchoEngine(Engine):
    """Answers every request with "x" × max_tokens, one delta per token (a resumed request: the "x"s still to
    generate, so a migrated stream reads as an undisturbed one)."""

    resumes = True

    def __init__(self, served_name: str = "echo", hidden_size: int = 576, max_context_tokens: int = 1 << 20) -> None:
        self._info = ModelInfo(served_name, "echo", hidden_size, max_context_tokens, "float32", 49152, 256)
        self._stats = EngineStats()
        self._running: set[str] = set()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        return None

    def info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        self._stats.active_requests = len(self._running)
        return self._stats

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        rid = request.request_id
        self._running.add(rid)
        try:
            n = request.sampling.max_tokens
            for i in range(1, n + 1):
                if rid in self._aborted:
                    self._stats.aborted_requests += 1
                    yield GenerationDelta("", (), i - 1, FinishReason.ABORT)
                    return
                self._stats.generated_tokens += 1
                if i == n:
                    # Counted before the last delta leaves: the caller may close the stream right after it.
                    self._stats.completed_requests += 1
                yield GenerationDelta("x", (87,), i, FinishReason.LENGTH if i == n else None)
                if i % 64 == 0:
                    await asyncio.sleep(0)
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def abort(self, request_id: str) -> bool:
        if request_id in self._running:
            self._aborted.add(request_id)
            return True
        return False

"""The echo engine (``engines/echo/engine.py``): ``max_tokens`` deltas of "x" (token 87), the last one finishing
with LENGTH; abort ends a running sequence with ABORT; stats count what happened; the model info it claims."""

from __future__ import annotations

import asyncio

from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import FinishReason, GenerationDelta, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.echo.engine import EchoEngine


def _req(rid: str, n: int) -> GenerationRequest:
    return GenerationRequest(rid, [TokenSegment((1, 2))], SamplingParams(max_tokens=n))


async def _all(engine: EchoEngine, req: GenerationRequest) -> list[GenerationDelta]:
    return [d async for d in engine.generate(req)]


def test_max_tokens_deltas_of_x_then_length() -> None:
    engine = EchoEngine()
    out = asyncio.run(_all(engine, _req("r", 3)))
    assert out == [GenerationDelta("x", (87,), 1), GenerationDelta("x", (87,), 2),
                   GenerationDelta("x", (87,), 3, FinishReason.LENGTH)]
    s = engine.stats()
    assert (s.completed_requests, s.generated_tokens, s.active_requests, s.aborted_requests) == (1, 3, 0, 0)


def test_info_claims_the_configured_name_and_width() -> None:
    info = EchoEngine("bench", hidden_size=16, max_context_tokens=99).info()
    assert (info.model, info.engine, info.hidden_size, info.max_context_tokens, info.dtype, info.vocab_size,
            info.max_batch_size, info.task) == ("bench", "echo", 16, 99, "float32", 49152, 256, "generate")


def test_abort_ends_a_running_sequence_and_only_a_running_one() -> None:
    async def run() -> None:
        engine = EchoEngine()
        stream = engine.generate(_req("r", 10))
        first = await stream.__anext__()
        assert first.completion_tokens == 1 and engine.stats().active_requests == 1
        assert await engine.abort("r") is True
        rest = [d async for d in stream]
        assert rest == [GenerationDelta("", (), 1, FinishReason.ABORT)]
        s = engine.stats()
        assert (s.aborted_requests, s.completed_requests, s.active_requests) == (1, 0, 0)
        assert await engine.abort("r") is False and await engine.abort("never") is False

    asyncio.run(run())


def test_a_closed_stream_is_no_longer_running() -> None:
    async def run() -> None:
        engine = EchoEngine()
        stream = engine.generate(_req("r", 10))
        await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
        assert engine.stats().active_requests == 0 and await engine.abort("r") is False

    asyncio.run(run())


def test_long_streams_yield_to_the_loop() -> None:
    async def run() -> None:
        engine = EchoEngine()
        ticks = 0

        async def other() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(other())
        await asyncio.sleep(0)
        before = ticks
        out = await _all(engine, _req("r", 640))
        t.cancel()
        assert len(out) == 640 and ticks - before >= 9  # one hop every 64 tokens
    asyncio.run(run())

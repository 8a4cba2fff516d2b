"""The preprocessor's GenerateMany client (``preprocessor/worker_stream.py``) against a real worker servicer on a
real gRPC server: generations share one stream and come back as a Generate call gives them, a generation's error
is an AioRpcError with the worker's details, cancel aborts it in the engine, a stream the worker ended (drain) or
lost fails what was on it and the next generation opens a new one, a worker without GenerateMany is served by
Generate calls, the caller's trace context rides in each frame, and the pipeline retries a sequence a draining
worker refused on another worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.transport.thresholds import SHARED_STREAM_MAX as MAX_STREAM_BODY
from embedmesh.services.preprocessor.pipeline import _one
from embedmesh.services.preprocessor.worker_stream import WorkerStream
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.worker import many
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.cut_call import CutCall
from tests.support.engines import SlowEcho

SERVICE = "embedmesh.worker.v1.WorkerService"


def _body(request_id: str, max_tokens: int = 3) -> bytes:
    req = worker_pb2.GenerateRequest(request_id=request_id)
    req.segments.add().token_ids.ids.extend([1, 2, 3])
    req.sampling.max_tokens = max_tokens
    return req.SerializeToString()


async def _serve(servicer: Any) -> Server:
    server = Server("w", ServerOptions(port=0, grace_seconds=0))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer, SERVICE)
    await server.start()
    await server.set_serving(True)
    return server


async def _worker(delay: float = 0.0) -> tuple[WorkerServicer, Server]:
    servicer = WorkerServicer(SlowEcho(delay), "w-1")
    await servicer.engine.start()
    return servicer, await _serve(servicer)


async def _text(generation: Any) -> tuple[str, int]:
    text, finish = "", 0
    async for r in generation:
        text += r.text
        finish = r.finish_reason or finish
    return text, finish


def test_many_generations_share_one_stream_and_come_back_as_calls_give_them() -> None:
    async def run() -> None:
        servicer, server = await _worker()
        stream = WorkerStream(server.address, 64 << 20)
        try:
            got = await asyncio.gather(*(_text(stream.generate(_body(f"r{i}", 1 + i % 7))) for i in range(50)))
            assert got == [("x" * (1 + i % 7), common_pb2.FINISH_REASON_LENGTH) for i in range(50)]
            assert servicer.many.open_streams() == 1  # one stream
            assert servicer.engine.stats().completed_requests == 50
        finally:
            await stream.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_generation_error_is_an_rpc_error_with_the_workers_details_and_the_stream_goes_on() -> None:
    async def run() -> None:
        _, server = await _worker()
        stream = WorkerStream(server.address, 64 << 20)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _text(stream.generate(_body("", 2)))  # no request_id
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            err = from_rpc_error(info.value)
            assert err.field == "request_id" and err.reason == "REQUIRED"
            assert await _text(stream.generate(_body("next", 2))) == ("xx", common_pb2.FINISH_REASON_LENGTH)
        finally:
            await stream.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_cancel_aborts_the_generation_in_the_engine() -> None:
    async def run() -> None:
        servicer, server = await _worker(delay=0.01)
        stream = WorkerStream(server.address, 64 << 20)
        try:
            generation = stream.generate(_body("long", 1000))
            await generation.__anext__()
            assert generation.cancel() is True
            engine = servicer.engine
            assert isinstance(engine, SlowEcho)
            async with asyncio.timeout(5):
                while "long" not in engine.closed:
                    await asyncio.sleep(0.01)
            assert engine.stats().completed_requests == 0
            assert generation.cancel() is False  # already ended
            assert await _text(stream.generate(_body("after", 2))) == ("xx", common_pb2.FINISH_REASON_LENGTH)
        finally:
            await stream.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_stream_the_worker_ended_fails_what_was_on_it_and_the_next_generation_opens_a_new_one() -> None:
    async def run() -> None:
        servicer, server = await _worker(delay=0.01)
        stream = WorkerStream(server.address, 64 << 20)
        try:
            running = stream.generate(_body("a", 10))
            await running.__anext__()
            await servicer.many.start_drain()
            refused = stream.generate(_body("b", 2))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _text(refused)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert from_rpc_error(info.value).reason == "WORKER_DRAINING"
            rest, finish = await _text(running)  # the running one finishes; then the worker ends the stream
            assert finish == common_pb2.FINISH_REASON_LENGTH and len(rest) == 9
            # A generation sent as the worker ends the stream fails as draining (retried elsewhere, not "lost").
            late = stream.generate(_body("late", 2))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _text(late)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert from_rpc_error(info.value).reason == "WORKER_DRAINING"
            servicer.many.draining = False
            assert await _text(stream.generate(_body("c", 2))) == ("xx", common_pb2.FINISH_REASON_LENGTH)
        finally:
            await stream.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_lost_worker_fails_every_generation_on_the_stream_as_unavailable_without_details() -> None:
    async def run() -> None:
        _, server = await _worker(delay=0.02)
        stream = WorkerStream(server.address, 64 << 20)
        try:
            generations = [stream.generate(_body(f"r{i}", 500)) for i in range(3)]
            for g in generations:
                await g.__anext__()
            await server._server.stop(0)  # connections reset, as when the process dies
            for g in generations:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _text(g)
                assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                trailing = info.value.trailing_metadata() or ()
                assert not any(k == "grpc-status-details-bin" for k, _ in trailing)
        finally:
            await stream.close()

    asyncio.run(run())


class _OldWorker(worker_pb2_grpc.WorkerServiceServicer):
    """A worker from before GenerateMany: Generate only."""

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        yield worker_pb2.GenerateResponse(text="old", token_ids=[1])
        yield worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH, completion_tokens=1)


def test_a_worker_without_generate_many_fails_the_generation_with_its_answer() -> None:
    """The mesh ships from one version: a worker that answers UNIMPLEMENTED is not asked again with Generate calls;
    each generation fails with that status (the pipeline handles it as any failed call)."""
    async def run() -> None:
        server = await _serve(_OldWorker())
        stream = WorkerStream(server.address, 64 << 20)
        try:
            for rid in ("a", "b"):
                generation = stream.generate(_body(rid))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _text(generation)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert not generation.cancel()  # what the pipeline does when a sequence ends: a no-op once ended
        finally:
            await stream.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_each_frame_carries_the_callers_trace_context(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple[str, str]]] = []
    real = many.Observed

    def recording(method: str, metadata: Any) -> Any:
        seen.append(list(metadata))
        return real(method, metadata)

    monkeypatch.setattr(many, "Observed", recording)

    async def run() -> None:
        _, server = await _worker()
        stream = WorkerStream(server.address, 64 << 20)
        tracer = TracerProvider().get_tracer("t")
        try:
            with tracer.start_as_current_span("caller") as span:
                await _text(stream.generate(_body("a")))
                trace_id = format(span.get_span_context().trace_id, "032x")
            await _text(stream.generate(_body("b")))  # no current span: no context
        finally:
            await stream.close()
            await server._server.stop(0)
        assert any(k == "traceparent" and trace_id in v for k, v in seen[0])
        assert seen[1] == []

    asyncio.run(run())


def test_the_pool_sends_small_requests_on_the_stream_and_large_ones_as_calls() -> None:
    async def run() -> None:
        servicer, server = await _worker()
        pool = WorkerPool((server.address,), 64 << 20)
        handle = pool.workers[0]
        try:
            small = handle.generate_raw(_body("s"))
            assert type(small).__name__ == "Generation"
            big_req = worker_pb2.GenerateRequest.FromString(_body("b"))
            big_req.segments.add().token_ids.ids.extend([5] * (MAX_STREAM_BODY + 1))
            big = big_req.SerializeToString()
            assert len(big) > MAX_STREAM_BODY
            large = handle.generate_raw(big)
            assert type(large).__name__ != "Generation"
            await _text(small)
            assert await _text(large) == ("xxx", common_pb2.FINISH_REASON_LENGTH)
            assert servicer.many.open_streams() == 1
            off = WorkerPool((server.address,), 64 << 20, worker_streams="off")
            assert type(off.workers[0].generate_raw(_body("o"))).__name__ != "Generation"
            await off.close()
            # "routed": a configured address (a proxy balancing per call) gets calls, an address the router
            # named (one worker) gets the stream.
            routed = WorkerPool((server.address,), 64 << 20, worker_streams="routed")
            assert type(routed.workers[0].generate_raw(_body("p"))).__name__ != "Generation"
            named = routed.handle_for("127.0.0.1:1")
            assert named.stream is not None and routed.workers[0].stream is None
            await routed.close()
            with pytest.raises(ValueError, match="all, routed or off"):
                WorkerPool((server.address,), 64 << 20, worker_streams="yes")
        finally:
            await pool.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_the_pipeline_retries_a_sequence_a_draining_worker_refused_on_another_worker() -> None:
    async def run() -> None:
        (draining, s1), (alive, s2) = await _worker(), await _worker()
        pool = WorkerPool((s1.address, s2.address), 64 << 20)
        pool.start()
        try:
            async with asyncio.timeout(10):
                while not all(h.healthy for h in pool.workers):
                    await asyncio.sleep(0.02)
            await draining.many.start_drain()
            out: asyncio.Queue[Any] = asyncio.Queue()

            async def pick() -> Any:
                return pool.workers[0]

            req = worker_pb2.GenerateRequest(request_id="r")
            await _one(0, req, pick, out, pool, "m", body=_body("r", 4))
            items = [out.get_nowait() for _ in range(out.qsize())]
            assert "".join(i[1].text for i in items) == "xxxx"
            assert alive.engine.stats().completed_requests == 1
            assert draining.engine.stats().completed_requests == 0
            assert pool.workers[0].healthy  # refused by the worker, not lost: still in the pool
            assert out.empty()
        finally:
            await pool.close()
            await s1._server.stop(0)
            await s2._server.stop(0)

    asyncio.run(run())


def test_the_stream_carries_the_mesh_token_and_a_stream_without_it_is_refused() -> None:
    from embedmesh.core import tls

    async def run() -> None:
        tls.configure(tls.Security(mesh_token="s3cret-token-value"))
        try:
            _, server = await _worker()
            stream = WorkerStream(server.address, 64 << 20)
            bare = grpc.aio.insecure_channel(server.address)
            try:
                assert await _text(stream.generate(_body("a", 2))) == ("xx", common_pb2.FINISH_REASON_LENGTH)
                frames = worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(
                    id=1, generate=worker_pb2.GenerateRequest.FromString(_body("b", 2)))])
                call = worker_pb2_grpc.WorkerServiceStub(bare).GenerateMany(iter([frames]))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    _ = [m async for m in call]
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            finally:
                await stream.close()
                await bare.close()
                await server._server.stop(0)
        finally:
            tls.configure(tls.Security())

    asyncio.run(run())


def test_bytes_that_are_not_frames_end_the_stream_with_invalid_argument() -> None:
    async def run() -> None:
        servicer, server = await _worker()
        channel = grpc.aio.insecure_channel(server.address)
        try:
            call = channel.stream_stream("/embedmesh.worker.v1.WorkerService/GenerateMany", request_serializer=None,
                                         response_deserializer=None)(iter([b"\xff\xff\xff\xff"]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [m async for m in call]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            err = from_rpc_error(info.value)
            assert err.field == "request" and err.reason == "MALFORMED_MESSAGE"
            # The worker goes on serving.
            stream = WorkerStream(server.address, 64 << 20)
            assert await _text(stream.generate(_body("ok", 2))) == ("xx", common_pb2.FINISH_REASON_LENGTH)
            await stream.close()
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_stream_cut_as_a_frame_is_written_fails_unanswered_generations_as_draining_and_started_ones_as_lost() -> None:
    """grpc.aio reports a write its core refused (the worker ended the stream at that moment) as INTERNAL with the
    worker's status lost: a generation the worker never answered is retried elsewhere (draining); one it had started
    on fails as lost (UNAVAILABLE, no WORKER_DRAINING), never INTERNAL."""
    from embedmesh.services.preprocessor.worker_stream import _Session

    started = worker_pb2.GenerateManyResponse(results=[worker_pb2.GenerateResult(
        id=1, response=worker_pb2.GenerateResponse(text="x"))])

    async def run() -> None:
        from embedmesh.services.preprocessor.worker_stream import Generation

        session = _Session(lambda: CutCall(started))
        running, waiting = (Generation(session, session.next_id()) for _ in range(2))
        session.sinks.update({1: running, 2: waiting})
        assert (await running.__anext__()).text == "x"
        session.send(b"frame")
        for generation, drained in ((running, False), (waiting, True)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(_text(generation), 5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (from_rpc_error(info.value).reason == "WORKER_DRAINING") is drained

    asyncio.run(run())

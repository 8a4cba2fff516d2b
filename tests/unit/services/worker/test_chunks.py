"""Big prompts on GenerateMany on a real gRPC server: a start frame whose embeds tensors carry no data, then ``rows``
frames (``worker/many.py``, ``pieces.expect``, ``wire.parse_generate_many``): rows split anywhere reach
the engine exactly as sent, laid out aligned; the generation is then checked as any other; a generation that breaks
a rule — rows before its start, a second start of a running id, too many or too few bytes, rows past the message
limit, a bad shape, bytes that are not a message, no mesh token — ends with an error naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from embedmesh.core import tls
from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.transport import wire
from embedmesh.services.worker.engines.base import EmbedsSegment, TokenSegment
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.engines import SlowEcho
from tests.support.worker_generate import worker_generate

SERVICE = "embedmesh.worker.v1.WorkerService"
HIDDEN = 4
FP32 = tensor_pb2.DATA_TYPE_FP32


class _Seeing(SlowEcho):
    """Echo that keeps every request it generates for."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        self.seen.append(request)
        async for delta in super().generate(request):
            yield delta


async def _serve(max_message_bytes: int = 512 << 20) -> tuple[_Seeing, Server, grpc.aio.Channel]:
    engine = _Seeing()
    await engine.start()
    server = Server("w", ServerOptions(port=0, grace_seconds=0))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server,
               WorkerServicer(engine, "w-1", max_message_bytes=max_message_bytes), SERVICE)
    await server.start()
    await server.set_serving(True)
    return engine, server, grpc.aio.insecure_channel(server.address)


def _raw_call(channel: grpc.aio.Channel, messages: Any, **kw: Any) -> Any:
    return worker_generate(channel, raw=messages, **kw)


def _frames(request: bytes, rows: list[memoryview], size: int) -> list[bytes]:
    """The GenerateMany messages of generation 1: its start frame, then its rows in frames of ``size`` bytes."""
    return [wire.frame_start(1, request)] + [wire.frame_rows(1, piece) for _, piece in wire.row_pieces(rows, size)]


def _request(*pieces: tuple[int, ...] | np.ndarray, max_tokens: int = 2) -> tuple[bytes, list[memoryview]]:
    header = worker_pb2.GenerateRequest(request_id="r1")
    header.sampling.max_tokens = max_tokens
    segments, rows = wire.chunked_segments(list(pieces), FP32)
    return header.SerializeToString() + segments, rows


async def _error(call: Any) -> Any:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [r async for r in call]
    return info.value


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, HIDDEN)).astype(np.float32)


def test_rows_split_anywhere_reach_the_engine_as_sent_and_aligned() -> None:
    async def run() -> None:
        engine, server, channel = await _serve()
        try:
            a, b = _rows(3000, 1), _rows(1700, 2)
            request, rows = _request(a, (5, 6, 7), b)
            # piece sizes that cut rows, floats and the boundary between the two tensors
            messages = _frames(request, [memoryview(b"".join(rows))], 4099)
            got = [r async for r in _raw_call(channel, messages)]
            assert "".join(r.text for r in got) == "xx"
            assert got[-1].prompt_tokens == 3000 + 3 + 1700
            (req,) = engine.seen
            segs = req.segments
            assert [type(s) for s in segs] == [EmbedsSegment, TokenSegment, EmbedsSegment]
            np.testing.assert_array_equal(segs[0].rows, a)
            assert segs[1].ids == (5, 6, 7)
            np.testing.assert_array_equal(segs[2].rows, b)
            assert all(s.rows.ctypes.data % 16 == 0 for s in (segs[0], segs[2]))
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_tensor_that_carries_its_own_data_needs_no_rows_and_generate_checks_still_apply() -> None:
    async def run() -> None:
        engine, server, channel = await _serve()
        try:
            own = _rows(2)
            req = worker_pb2.GenerateRequest(request_id="r2")
            req.sampling.max_tokens = 1
            req.segments.add().embeds.CopyFrom(tensor_pb2.Tensor(dtype=FP32, shape=[2, HIDDEN], data=own.tobytes()))
            got = [r async for r in worker_generate(channel, req)]
            assert got[-1].prompt_tokens == 2
            np.testing.assert_array_equal(engine.seen[0].segments[0].rows, own)

            bad = _rows(8)
            bad[5, 1] = np.nan
            request, rows = _request(bad)
            err = await _error(_raw_call(channel, _frames(request, rows, 40)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert from_rpc_error(err).reason == "NON_FINITE" and err.details().startswith("prompt_embeds:")

            assert len(engine.seen) == 1  # nothing that broke a rule reached the engine
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


def _rows_message(data: bytes) -> bytes:
    return wire.frame_rows(1, data)


@pytest.mark.parametrize("case, field, reason", [
    ("rows first", "rows", "UNKNOWN_GENERATION"),
    ("nothing", "action", "REQUIRED"),
    ("two requests", "id", "DUPLICATE_ID"),
    ("too many bytes", "rows", "TOO_MANY_BYTES"),
    ("too few bytes", "rows", "INCOMPLETE"),
    ("past the limit", "segments[0].embeds.shape", "TOO_LARGE"),
    ("bad shape", "segments[0].embeds.shape", "INVALID_SHAPE"),
    ("not a message", "request", "MALFORMED_MESSAGE"),
])
def test_a_stream_that_breaks_a_rule_is_refused_by_name(case: str, field: str, reason: str) -> None:
    async def run() -> None:
        engine, server, channel = await _serve(max_message_bytes=1 << 20)
        try:
            request, rows = _request(_rows(100))
            data = b"".join(rows)
            first = wire.frame_start(1, request)
            # rows beside their start in one message: read in one go, so nothing runs in between
            start_and_rows = first + _rows_message(data)
            messages = {
                "rows first": [_rows_message(data), first],
                "nothing": [worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=1)])
                            .SerializeToString()],
                "two requests": [first, first],
                "too many bytes": [start_and_rows + _rows_message(b"\0" * 4)],
                "too few bytes": [first, _rows_message(data[:-4])],
                "past the limit": [wire.frame_start(1, _request(np.zeros((70000, HIDDEN), np.float32))[0])],
                "bad shape": [wire.frame_start(1, worker_pb2.GenerateRequest(
                    request_id="x", segments=[worker_pb2.PromptSegment(embeds=tensor_pb2.Tensor(
                        dtype=FP32, shape=[-1, HIDDEN]))]).SerializeToString())],
                "not a message": [first, b"\x0a\xff\xff"],
            }[case]
            err = await _error(_raw_call(channel, messages))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            e = from_rpc_error(err)
            assert (e.field, e.reason) == (field, reason), err.details()
            assert engine.seen == []
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_stream_without_the_mesh_token_is_refused() -> None:
    async def run() -> None:
        tls.configure(tls.Security(mesh_token="s3cret-token-value"))
        try:
            engine, server, channel = await _serve()
            try:
                # one message (a tensor with its data): a refusal while the client still writes surfaces as
                # grpc.aio's own INTERNAL on the client, whatever the server answered
                req = worker_pb2.GenerateRequest(request_id="t", segments=[worker_pb2.PromptSegment(
                    embeds=tensor_pb2.Tensor(dtype=FP32, shape=[2, HIDDEN], data=_rows(2).tobytes()))])
                req.sampling.max_tokens = 2
                messages = [wire.frame_start(1, req.SerializeToString())]
                err = await _error(_raw_call(channel, messages))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                call = _raw_call(channel, messages, metadata=((tls.MESH_TOKEN_HEADER, "s3cret-token-value"),))
                assert "".join([r.text async for r in call]) == "xx"
                assert len(engine.seen) == 1
            finally:
                await channel.close()
                await server._server.stop(0)
        finally:
            tls.configure(tls.Security())

    asyncio.run(run())


def test_rows_frames_are_read_as_views_and_parse_as_protobuf_does() -> None:
    data = bytes(range(256)) * 64
    raw = wire.frame_rows(7, data)
    piece = wire.parse_generate_many(raw)
    assert isinstance(piece, wire.RowsFrame) and piece.id == 7 and bytes(piece.data) == data
    assert piece.data.obj is raw  # a view of the received bytes, not a copy
    assert WorkerServicer.request_parsers["GenerateMany"] is wire.parse_generate_many  # what Server.add installs
    assert worker_pb2.GenerateManyRequest.FromString(raw).frames[0].rows == data  # what protobuf reads
    start = wire.frame_start(1, worker_pb2.GenerateRequest(request_id="a", lora_adapter="x" * 5000)
                             .SerializeToString())
    for other in (start,
                  wire.frame_rows(7, b"ab"),  # small: protobuf is as fast
                  raw + wire.frame_rows(8, b"cd")):  # a second frame: protobuf decides
        parsed = wire.parse_generate_many(other)
        assert parsed == worker_pb2.GenerateManyRequest.FromString(other)
    with pytest.raises(DecodeError):  # as protobuf words it (the server turns it into MALFORMED_MESSAGE)
        wire.parse_generate_many(b"\x0a\xff\xff" + b"\0" * 5000)


def test_frames_parse_back_to_the_request_and_its_rows() -> None:
    a, b = _rows(33), _rows(17, 3)
    request, rows = _request((1, 2), a, b)
    messages = _frames(request, rows, 100)
    parsed = [worker_pb2.GenerateManyRequest.FromString(m).frames[0] for m in messages]
    assert parsed[0].WhichOneof("action") == "generate" and parsed[0].id == 1
    head = parsed[0].generate
    assert list(head.segments[0].token_ids.ids) == [1, 2]
    assert [list(s.embeds.shape) for s in head.segments[1:]] == [[33, HIDDEN], [17, HIDDEN]]
    assert all(len(s.embeds.data) == 0 for s in head.segments[1:])
    assert all(p.WhichOneof("action") == "rows" and p.id == 1 and len(p.rows) <= 100 for p in parsed[1:])
    assert b"".join(p.rows for p in parsed[1:]) == a.tobytes() + b.tobytes()


async def _queued(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (message := await queue.get()) is not None:
        yield message


def test_rows_after_a_generation_started_end_it_and_silence_ends_one_still_owed_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes past the shapes that come once the generation runs end it (TOO_MANY_BYTES, the engine aborts it); rows
    still owed with nothing arriving for ``pieces.IDLE_SECONDS`` end theirs (IDLE_TIMEOUT): neither waits for the
    stream to end."""
    from embedmesh.core.transport import pieces

    async def run() -> None:
        engine, server, channel = await _serve()
        engine.delay = 0.05
        try:
            request, rows = _request(_rows(10), max_tokens=50)
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()
            for m in _frames(request, rows, 1 << 20):
                queue.put_nowait(m)
            call = _raw_call(channel, _queued(queue))
            first = await call.__anext__()  # it runs
            assert first.text == "x"
            queue.put_nowait(_rows_message(b"\0" * 4))
            err = await _error(call)
            e = from_rpc_error(err)
            assert (err.code(), e.field, e.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "rows", "TOO_MANY_BYTES")
            async with asyncio.timeout(5):
                while engine.closed != ["r1"]:  # aborted in the engine, not left running
                    await asyncio.sleep(0.01)
            queue.put_nowait(None)

            monkeypatch.setattr(pieces, "IDLE_SECONDS", 0.2)
            request, rows = _request(_rows(10))
            silent: asyncio.Queue[bytes | None] = asyncio.Queue()
            silent.put_nowait(wire.frame_start(1, request))
            silent.put_nowait(_rows_message(bytes(rows[0][:8])))
            err = await _error(_raw_call(channel, _queued(silent)))
            e = from_rpc_error(err)
            assert (err.code(), e.field, e.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "rows", "IDLE_TIMEOUT")
            assert len(engine.seen) == 1
            silent.put_nowait(None)
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())

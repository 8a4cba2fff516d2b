"""Junk on the worker's GenerateMany from a mesh caller (``worker/many.py``, ``pieces.expect``), over real gRPC:
a start declaring 2**40 bytes of rows is refused before anything is allocated, zero-length rows change nothing,
rows for an id never started or already finished are refused by name without touching the other generation on the
stream, and two big generations whose starts and rows interleave each get exactly their own bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.core.errors import from_rpc_error, rpc_error_from_status
from embedmesh.core.transport import wire
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2
from tests.unit.services.worker.test_chunks import FP32, HIDDEN, _error, _raw_call, _request, _rows, _serve

GENERATE_MANY = "/embedmesh.worker.v1.WorkerService/GenerateMany"


def _results(channel: grpc.aio.Channel, messages: list[bytes]) -> Any:
    """Every GenerateResult of the stream, all ids, in order."""
    call = channel.stream_stream(GENERATE_MANY, request_serializer=None,
                                 response_deserializer=worker_pb2.GenerateManyResponse.FromString)(iter(messages))

    async def collect() -> list[worker_pb2.GenerateResult]:
        return [r async for m in call for r in m.results]

    return collect()


def _start(gid: int, request: bytes) -> bytes:
    return wire.frame_start(gid, request)


def test_a_start_declaring_2_40_bytes_is_refused_before_allocation_by_name() -> None:
    async def run() -> None:
        engine, server, channel = await _serve(max_message_bytes=1 << 20)
        try:
            huge = worker_pb2.GenerateRequest(request_id="h", segments=[worker_pb2.PromptSegment(
                embeds=tensor_pb2.Tensor(dtype=FP32, shape=[2**26, 4096]))])
            err = await _error(_raw_call(channel, [_start(1, huge.SerializeToString())]))
            e = from_rpc_error(err)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert (e.field, e.reason) == ("segments[0].embeds.shape", "TOO_LARGE")
            assert engine.seen == []
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_zero_length_rows_change_nothing_and_rows_for_unknown_or_finished_ids_are_refused_alone() -> None:
    async def run() -> None:
        engine, server, channel = await _serve()
        try:
            a = _rows(50, 1)
            request, rows = _request(a)
            data = b"".join(rows)
            messages = [wire.frame_rows(9, data[:16]),  # an id never started
                        _start(1, request), wire.frame_rows(1, b""), wire.frame_rows(1, data[:100]),
                        wire.frame_rows(1, b""), wire.frame_rows(1, data[100:])]
            results = await _results(channel, messages)
            by_id: dict[int, list[worker_pb2.GenerateResult]] = {}
            for r in results:
                by_id.setdefault(r.id, []).append(r)
            (nine,) = by_id[9]
            e = from_rpc_error(rpc_error_from_status(nine.error))
            assert (e.field, e.reason) == ("rows", "UNKNOWN_GENERATION")
            assert by_id[1][-1].WhichOneof("result") == "end"
            assert "".join(r.response.text for r in by_id[1][:-1]) == "xx"
            np.testing.assert_array_equal(engine.seen[0].segments[0].rows, a)

            # a generation that finished: its id is not running any more
            own = worker_pb2.GenerateRequest(request_id="r2", segments=[worker_pb2.PromptSegment(
                embeds=tensor_pb2.Tensor(dtype=FP32, shape=[2, HIDDEN], data=_rows(2).tobytes()))])
            own.sampling.max_tokens = 1
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()
            queue.put_nowait(_start(1, own.SerializeToString()))
            call = channel.stream_stream(GENERATE_MANY, request_serializer=None,
                                         response_deserializer=worker_pb2.GenerateManyResponse.FromString)(
                _queued(queue))
            seen: list[worker_pb2.GenerateResult] = []
            async for m in call:
                seen.extend(m.results)
                if seen[-1].WhichOneof("result") == "end":
                    queue.put_nowait(wire.frame_rows(1, b"\0" * 16))  # rows after its end
                elif seen[-1].WhichOneof("result") == "error":
                    queue.put_nowait(None)
            e = from_rpc_error(rpc_error_from_status(seen[-1].error))
            assert (seen[-1].id, e.field, e.reason) == (1, "rows", "UNKNOWN_GENERATION")
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


async def _queued(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (message := await queue.get()) is not None:
        yield message


def test_two_big_generations_with_interleaved_starts_and_rows_each_get_their_own_bytes() -> None:
    async def run() -> None:
        engine, server, channel = await _serve()
        try:
            a, b = _rows(3000, 1), _rows(2000, 2)
            ra, rows_a = _request(a)
            rb, rows_b = _request(b)
            da, db = b"".join(rows_a), b"".join(rows_b)
            messages = [_start(1, ra), _start(2, rb)]
            step = 4099
            for i in range(0, max(len(da), len(db)), step):
                if i < len(db):
                    messages.append(wire.frame_rows(2, db[i:i + step]))
                if i < len(da):
                    messages.append(wire.frame_rows(1, da[i:i + step]))
            # one too many for 2: refused by name, whether 2 is still running or already ended
            messages.append(wire.frame_rows(2, b"\0" * 4))
            results = await _results(channel, messages)
            last = {r.id: r for r in results}
            assert last[1].WhichOneof("result") == "end"
            assert last[2].WhichOneof("result") == "error"
            e = from_rpc_error(rpc_error_from_status(last[2].error))
            assert e.field == "rows" and e.reason in ("TOO_MANY_BYTES", "UNKNOWN_GENERATION")
            got = {len(s.segments[0].rows): s.segments[0].rows for s in engine.seen}
            np.testing.assert_array_equal(got[3000], a)
            np.testing.assert_array_equal(got[2000], b)
        finally:
            await channel.close()
            await server._server.stop(0)

    asyncio.run(run())


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.engines import SlowEcho

    monkeypatch.setattr(SlowEcho, "delay", 0.0, raising=False)

"""``transport.received``: a request's tensors as explicit values. A tensor's bytes come from the message, or from the
views cut out of the received buffer, or from rows still arriving on a pieces stream — and only the last carry an
``Arriving`` mark, whose ``wait`` holds a reader until the bytes it needs arrived and were checked (or raises the
stream's error, a fresh copy for every waiter)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.transport import pieces
from embedmesh.core.transport.received import Received, WireTensor
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

FP32 = tensor_pb2.DATA_TYPE_FP32


def _header(shape: list[int], data: bytes = b"") -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=FP32, shape=shape, data=data)


def test_a_tensor_reads_its_bytes_from_the_views_uncopied_and_its_own_data_first() -> None:
    rows = np.arange(12, dtype="<f4").reshape(3, 4)
    buf = bytearray(rows.tobytes())
    received = Received(object(), {"prompt_embeds": memoryview(buf)})
    t = received.tensor("prompt_embeds", _header([3, 4]))
    assert t.arriving is None  # one message: nothing still arriving
    arr, dtype = t.read("prompt_embeds")
    assert dtype == FP32 and np.array_equal(arr, rows)
    assert np.shares_memory(arr, np.frombuffer(buf, np.uint8))  # a view of the received bytes
    own = received.tensor("prompt_embeds", tensors.from_numpy(rows + 1))  # bytes inside the message win
    assert np.array_equal(own.read("prompt_embeds")[0], rows + 1)
    other = received.tensor("prompt_embeds[1]", _header([3, 4]))  # another path: no bytes anywhere
    with pytest.raises(InvalidArgument) as e:
        other.read("prompt_embeds[1]")
    assert (e.value.field, e.value.reason) == ("prompt_embeds[1].data", "DATA_SIZE_MISMATCH")
    assert not t.scanned and not own.scanned  # a reader scans these itself


def _request(*shapes: list[int]) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(
        completion=inference_pb2.CompletionParams(
            model="m", prompt_embeds=[inference_pb2.PromptEmbeds(tensor=_header(s)) for s in shapes])))


def _tensors(h: inference_pb2.GenerateHeader) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    for i, pe in enumerate(h.completion.prompt_embeds):
        yield f"prompt_embeds[{i}]", pe.tensor


class _Feed:
    """A pieces stream the test feeds message by message."""

    def __init__(self, first: Any) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queue.put_nowait(first)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item


def _rows(data: bytes) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(rows=data)


async def test_rows_checked_as_they_land_are_marked_arriving_and_wait_for_their_bytes() -> None:
    feed = _Feed(_request([2, 4], [0, 4]))
    arrival = await pieces.start(feed, _tensors, 1 << 20, scan_for=lambda r: pieces.finite_scan(FP32, "x"))
    received = arrival.received()
    header = received.message
    t = received.tensor("prompt_embeds[0]", header.completion.prompt_embeds[0].tensor)
    assert t.arriving is not None and t.arriving.nbytes == 32
    # an empty tensor needs no bytes: nothing to wait for
    assert received.tensor("prompt_embeds[1]", header.completion.prompt_embeds[1].tensor).arriving is None
    first_row = asyncio.ensure_future(t.arriving.wait(16))
    await asyncio.sleep(0)
    assert not first_row.done()  # no byte yet
    feed.queue.put_nowait(_rows(np.ones(4, "<f4").tobytes()))
    await asyncio.wait_for(first_row, 5)
    arr, _ = t.read("prompt_embeds[0]")
    assert np.array_equal(arr[0], np.ones(4))  # the first row is there, checked
    feed.queue.put_nowait(_rows(np.full(4, 2, "<f4").tobytes()))
    feed.queue.put_nowait(None)
    await asyncio.wait_for(arrival.finished(), 5)
    assert np.array_equal(t.read("prompt_embeds[0]")[0], [[1] * 4, [2] * 4])
    # once every byte arrived the mark stays: these bytes were scanned as they landed, a reader need not again
    after = arrival.received().tensor("prompt_embeds[0]", header.completion.prompt_embeds[0].tensor)
    assert after.scanned and after.arriving is not None


async def test_rows_used_only_once_whole_carry_no_mark() -> None:
    feed = _Feed(_request([1, 4]))
    arrival = await pieces.start(feed, _tensors, 1 << 20)  # no scan: the bytes are used only once all arrived
    feed.queue.put_nowait(_rows(b"\0" * 16))
    feed.queue.put_nowait(None)
    await arrival.finished()
    received = arrival.received()
    assert received.arrival is None
    t = received.tensor("prompt_embeds[0]", received.message.completion.prompt_embeds[0].tensor)
    assert t.arriving is None and not t.scanned and t.data is not None and len(t.data) == 16


async def test_a_broken_stream_reaches_every_waiter_as_its_own_copy_of_the_rule() -> None:
    feed = _Feed(_request([2, 4]))
    arrival = await pieces.start(feed, _tensors, 1 << 20, scan_for=lambda r: pieces.finite_scan(FP32, "prompt_embeds"))
    t = arrival.received().tensor("prompt_embeds[0]", _header([2, 4]))
    assert t.arriving is not None
    waiters = [asyncio.ensure_future(t.arriving.wait(32)) for _ in range(2)]
    feed.queue.put_nowait(_rows(np.array([1, np.nan, 3, 4], "<f4").tobytes()))
    errors = []
    for w in waiters:
        with pytest.raises(InvalidArgument) as e:
            await asyncio.wait_for(w, 5)
        errors.append(e.value)
    assert all((x.field, x.reason) == ("prompt_embeds", "NON_FINITE") for x in errors)
    assert errors[0] is not errors[1] and arrival.error not in errors  # each waiter its own copy
    assert arrival.error is not None and arrival.error.__traceback__ is None  # the kept one holds no frames
    assert arrival.buffers == [] and arrival.views == {}  # and the rows are let go


def test_a_wire_tensor_is_a_value() -> None:
    a = WireTensor(_header([1, 4]), memoryview(b"\0" * 16))
    with pytest.raises(AttributeError):
        a.data = None  # type: ignore[misc]

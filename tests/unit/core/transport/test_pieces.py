"""``pieces.assemble`` on its own: bytes split anywhere land in each tensor in order (empty tensors and tensors
that carry their own data need none), the limit counts every tensor together before anything is allocated, and
each broken rule is an InvalidArgument naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.transport import pieces, wire
from embedmesh.core.transport.received import Received
from embedmesh.inference.v1 import inference_pb2
from embedmesh.services.preprocessor.servicer import InferenceServicer
from embedmesh.tensor.v1 import tensor_pb2

FP32, FP16 = tensor_pb2.DATA_TYPE_FP32, tensor_pb2.DATA_TYPE_FP16


def _tensors(request: inference_pb2.GenerateHeader) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    for i, pe in enumerate(request.completion.prompt_embeds):
        yield f"t{i}", pe.tensor


def _request(*specs: tuple[int, list[int], bytes]) -> inference_pb2.GenerateHeader:
    return inference_pb2.GenerateHeader(completion=inference_pb2.CompletionParams(prompt_embeds=[
        inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(dtype=d, shape=shape, data=data))
        for d, shape, data in specs]))


async def _stream(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _assemble(items: list[Any], max_bytes: int = 1 << 20) -> tuple[Any, dict[str, memoryview]]:
    received = asyncio.run(pieces.assemble(_stream(items), _tensors, max_bytes))
    return received.message, dict(received.views)


def _first(request: inference_pb2.GenerateHeader) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request=request)


def _rows(data: bytes) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(rows=data)


def test_bytes_split_anywhere_land_in_each_tensor_in_order() -> None:
    a = np.arange(15, dtype=np.float32).reshape(5, 3)
    b = np.arange(8, dtype=np.float16).reshape(2, 4)
    own = np.ones((1, 3), np.float32).tobytes()
    request = _request((FP32, [5, 3], b""), (FP32, [0, 3], b""), (FP32, [1, 3], own), (FP16, [2, 4], b""))
    data = a.tobytes() + b.tobytes()
    for size in (1, 3, 7, len(data)):
        parts = [_rows(data[i:i + size]) for i in range(0, len(data), size)]
        parts.insert(1, inference_pb2.GenerateRequest())  # an empty message places nothing
        got, views = _assemble([_first(request), *parts])
        assert got == request
        assert set(views) == {"t0", "t1", "t3"}  # t2 carries its own data
        np.testing.assert_array_equal(np.frombuffer(views["t0"], np.float32).reshape(5, 3), a)
        assert len(views["t1"]) == 0
        np.testing.assert_array_equal(np.frombuffer(views["t3"], np.float16).reshape(2, 4), b)


def test_rows_pieces_as_views_are_placed_like_messages() -> None:
    a = np.arange(12, dtype=np.float32)
    raw = _rows(a.tobytes() * 512).SerializeToString()  # big enough to be cut out as a view
    piece = wire.parse_chunk(inference_pb2.GenerateRequest)(raw)
    assert isinstance(piece, wire.RowsPiece)
    _, views = _assemble([_first(_request((FP32, [512, 12], b""))), piece])
    np.testing.assert_array_equal(np.frombuffer(views["t0"], np.float32).reshape(512, 12), np.tile(a, (512, 1)))


def test_a_header_with_tensors_cut_out_expects_rows_only_for_the_others() -> None:
    a = np.arange(2048, dtype=np.float32).reshape(128, 16)  # inline: cut out of the received bytes (transport.wire)
    b = np.arange(6, dtype=np.float32).reshape(2, 3)  # no data: its rows follow
    header = _request((FP32, [128, 16], a.tobytes()), (FP32, [2, 3], b""))
    first = InferenceServicer.request_parsers["Generate"](_first(header).SerializeToString())
    assert isinstance(first, Received) and set(first.views) == {"prompt_embeds[0]"}

    def tensors_of(h: inference_pb2.GenerateHeader) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
        for i, pe in enumerate(h.completion.prompt_embeds):
            yield f"prompt_embeds[{i}]", pe.tensor

    received = asyncio.run(pieces.assemble(_stream([first, _rows(b.tobytes())]), tensors_of, 1 << 20))
    got, views = received.message, received.views
    assert got.completion.prompt_embeds[0].tensor.data == b""  # left in the view
    np.testing.assert_array_equal(np.frombuffer(views["prompt_embeds[0]"], np.float32).reshape(128, 16), a)
    np.testing.assert_array_equal(np.frombuffer(views["prompt_embeds[1]"], np.float32).reshape(2, 3), b)
    # a second header, cut out or not, is refused as one
    with pytest.raises(InvalidArgument) as e:
        asyncio.run(pieces.assemble(_stream([first, _rows(b.tobytes()), first]), tensors_of, 1 << 20))
    assert e.value.field == "request" and e.value.reason == "DUPLICATE"


def test_the_limit_counts_every_tensor_together_before_anything_is_allocated() -> None:
    request = _request((FP32, [100, 10], b""), (FP32, [100, 10], b""))  # 4000 + 4000 bytes
    _assemble([_first(request), _rows(b"\0" * 8000)], max_bytes=8000)
    with pytest.raises(InvalidArgument) as info:
        _assemble([_first(request)], max_bytes=7999)
    assert (info.value.field, info.value.reason) == ("t1.shape", "TOO_LARGE")
    huge = _request((FP32, [2**31, 2**31], b""))  # would be 16 EiB: refused by the count, never allocated
    with pytest.raises(InvalidArgument) as info:
        _assemble([_first(huge)])
    assert (info.value.field, info.value.reason) == ("t0.shape", "TOO_LARGE")


@pytest.mark.parametrize("items, field, reason", [
    (lambda r: [_rows(b"\0" * 12), _first(r)], "request", "REQUIRED"),
    (lambda r: [], "request", "REQUIRED"),
    (lambda r: [_first(r), _rows(b"\0" * 12), _first(r)], "request", "DUPLICATE"),
    (lambda r: [_first(r), _rows(b"\0" * 13)], "rows", "TOO_MANY_BYTES"),
    (lambda r: [_first(r), _rows(b"\0" * 11)], "rows", "INCOMPLETE"),
    (lambda r: [_first(_request((FP32, [-1, 3], b"")))], "t0.shape", "INVALID_SHAPE"),
    (lambda r: [_first(_request((FP32, [1] * 9, b"")))], "t0.shape", "BAD_RANK"),
])
def test_each_broken_rule_is_refused_by_name(items: Any, field: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        _assemble(items(_request((FP32, [1, 3], b""))))
    assert (info.value.field, info.value.reason) == (field, reason)


def test_an_unknown_dtype_waits_for_no_bytes_and_is_left_to_the_ordinary_checks() -> None:
    request = _request((999, [2, 3], b""), (FP32, [1, 3], b""))
    _, views = _assemble([_first(request), _rows(b"\0" * 12)])
    assert set(views) == {"t1"}


async def _stalled(items: list[Any], stop: asyncio.Event) -> AsyncIterator[Any]:
    """``items``, then silence (a client that stops sending without ending its stream)."""
    for item in items:
        yield item
    await stop.wait()


@pytest.mark.parametrize("sent, field", [
    (lambda r: [], "request"),                             # connected, never sends the request
    (lambda r: [_first(r)], "rows"),                       # announces a tensor, never sends its rows
    (lambda r: [_first(r), _rows(b"\0" * 6)], "rows"),     # stops halfway
    (lambda r: [_first(r), _rows(b"\0" * 12)], "rows"),    # every byte, but the stream never ends
])
def test_a_stream_that_goes_silent_is_refused_after_the_idle_bound(sent: Any, field: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "IDLE_SECONDS", 0.2)

    async def run() -> InvalidArgument:
        stop = asyncio.Event()
        try:
            async with asyncio.timeout(10):  # the test's own bound: a hang fails it instead of blocking the suite
                with pytest.raises(InvalidArgument) as info:
                    await pieces.assemble(_stalled(sent(_request((FP32, [1, 3], b""))), stop), _tensors, 1 << 20)
            return info.value
        finally:
            stop.set()

    err = asyncio.run(run())
    assert (err.field, err.reason) == (field, "IDLE_TIMEOUT")
    assert "0.2 s" in err.message

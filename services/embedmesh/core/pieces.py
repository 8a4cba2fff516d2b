"""Requests whose tensors' bytes follow them in pieces: ``WorkerService.GenerateChunks`` (the preprocessor sends big
prompts to a worker this way) and ``InferenceService.CompleteChunks`` / ``StreamCompleteChunks`` (clients send big
``prompt_embeds`` this way).

One 64 MiB message costs more than its bytes: grpc.aio hands a received message to Python as a bytes object per
slice joined into one (two passes over memory that is no longer in cache), the sender first builds the whole message,
and nothing can start before its last byte arrived. Sent as ~1 MiB pieces, each piece is copied while it is still in
cache, no message size limit needs raising, and the receiver copies each piece once more into rows it allocated
itself — aligned, so the NaN/Inf scan runs at full speed (a tensor cut out of a protobuf message starts wherever its
field happened to start).

The stream (both messages have ``oneof part { request = 1; bytes rows = 2; }``): first ``request``, whose tensors
that carry no ``data`` give their dtype and shape; then ``rows`` pieces holding those tensors' bytes in order, split
anywhere. ``assemble`` checks the stream and returns the request with the bytes as views by field path, the way
``core.wire`` gives a one-message request's tensors (``tensors.to_numpy`` reads them from there), so the request is
then served exactly as the one-message method would serve it. A tensor that carries its own ``data`` is taken as it
is; one whose dtype is unknown expects no bytes here and is refused by name by the ordinary checks afterwards.

Refused with INVALID_ARGUMENT naming the field: a first message that is not a request (``request``, REQUIRED), a
second request (``request``, DUPLICATE), tensors declaring more bytes in all than ``max_bytes`` (``<path>.shape``,
TOO_LARGE), a shape out of range (``<path>.shape``, INVALID_SHAPE / BAD_RANK), more bytes than the shapes need
(``rows``, TOO_MANY_BYTES), the stream ending before they all arrived (``rows``, INCOMPLETE). Nothing is allocated
past the limit, and rows are allocated but not touched until their bytes arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import numpy as np

from embedmesh.core import tensors, wire
from embedmesh.core.errors import InvalidArgument
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["assemble"]

Tensors = Callable[[Any], Iterable[tuple[str, tensor_pb2.Tensor]]]
"""The tensors of a request, in the order their bytes follow it, each with its field path."""


def _wanted(request: Any, tensors_of: Tensors, max_bytes: int) -> list[tuple[str, int]]:
    """(field path, byte count) of every tensor whose bytes follow the request, in order."""
    out: list[tuple[str, int]] = []
    total = 0
    for path, tensor in tensors_of(request):
        if len(tensor.data):
            continue
        info = tensors.DTYPES.get(tensor.dtype)
        if info is None:
            continue  # refused by name when the request is read (tensors.to_numpy)
        count = tensors.check_shape(tuple(int(d) for d in tensor.shape), f"{path}.shape")
        total += count * info.numpy.itemsize
        if total > max_bytes:
            raise InvalidArgument(
                f"{path}.shape: the tensors of this request need {total} bytes or more; at most {max_bytes} are "
                f"accepted", field=f"{path}.shape", reason="TOO_LARGE")
        out.append((path, count * info.numpy.itemsize))
    return out


async def assemble(messages: AsyncIterator[Any], tensors_of: Tensors, max_bytes: int
                   ) -> tuple[Any, dict[str, memoryview]]:
    """The request of a pieces stream and its tensors' bytes by field path (see the module docstring).
    ``messages`` as ``wire.parse_chunk`` gives them: a rows-only message as a view of its bytes."""
    request: Any = None
    buffers: list[tuple[str, np.ndarray]] = []
    slot = 0
    filled = 0
    async for message in messages:
        part = "rows" if isinstance(message, wire.RowsPiece) else message.WhichOneof("part")
        if request is None:
            if part != "request":
                raise InvalidArgument("request: the first message of the stream must be the request",
                                      field="request", reason="REQUIRED")
            request = message.request
            # 64-byte aligned (numpy's allocator), untouched until the bytes arrive
            buffers = [(path, np.empty(size, np.uint8)) for path, size in _wanted(request, tensors_of, max_bytes)]
            continue
        if part == "request":
            raise InvalidArgument("request: the stream carries one request", field="request", reason="DUPLICATE")
        if part != "rows":
            continue  # an empty message: nothing to place
        # read once: each read of a protobuf bytes field copies
        piece = message.data if isinstance(message, wire.RowsPiece) else memoryview(message.rows)
        pos = 0
        while pos < len(piece):
            if slot == len(buffers):
                raise InvalidArgument(
                    f"rows: more bytes than the request's tensors need ({sum(b.size for _, b in buffers)})",
                    field="rows", reason="TOO_MANY_BYTES")
            buf = buffers[slot][1]
            take = min(buf.size - filled, len(piece) - pos)
            buf[filled:filled + take] = np.frombuffer(piece, np.uint8, take, pos)
            filled += take
            pos += take
            if filled == buf.size:
                slot += 1
                filled = 0
    if request is None:
        raise InvalidArgument("request: the stream ended before its request", field="request", reason="REQUIRED")
    while slot < len(buffers) and buffers[slot][1].size == filled:
        slot += 1  # empty tensors need no bytes
        filled = 0
    if slot < len(buffers):
        need = sum(b.size for _, b in buffers)
        got = sum(b.size for _, b in buffers[:slot]) + filled
        raise InvalidArgument(f"rows: the stream ended after {got} of the {need} bytes the request's tensors need",
                              field="rows", reason="INCOMPLETE")
    return request, {path: memoryview(buf) for path, buf in buffers}

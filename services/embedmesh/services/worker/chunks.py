"""``WorkerService.GenerateChunks``: a Generate request whose embedding rows arrive in pieces after it.

One 64 MiB message costs more than its bytes: grpc.aio hands a received message to Python as a bytes object per
slice joined into one (two passes over memory that is no longer in cache), and the sender first joins the request
into one buffer. Sent as ~1 MiB pieces, each piece is copied while it is still in cache, and the worker copies it
once more into rows it allocated itself — aligned, so the NaN/Inf scan runs at full speed (a tensor cut out of a
protobuf message starts wherever its field happened to start).

The stream: first ``request`` (a GenerateRequest whose embeds tensors give dtype and shape but carry no data), then
``rows`` pieces holding those tensors' bytes in segment order, split anywhere. ``assemble`` checks the stream and
returns the request with the rows as views by field path (``segments[i].embeds``, as ``core.wire`` gives them for a
Generate call), so the request then goes through ``WorkerServicer.Generate`` unchanged: the same checks, admission,
engine and errors. A tensor that carries its own ``data`` is taken as it is; a tensor whose dtype or shape is
unusable expects no bytes here and is refused by name by the ordinary check afterwards.

Refused with INVALID_ARGUMENT naming the field: a first message that is not a request (``request``, REQUIRED),
a second request (``request``, DUPLICATE), tensors declaring more bytes in all than ``max_bytes`` (the worker's
message size limit; ``segments[i].embeds.shape``, TOO_LARGE), more bytes than the shapes need (``rows``,
TOO_MANY_BYTES), the stream ending before they all arrived (``rows``, INCOMPLETE). Nothing is allocated past the
limit, and rows are allocated but not touched until their bytes arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from embedmesh.core import tensors, wire
from embedmesh.core.errors import InvalidArgument
from embedmesh.worker.v1 import worker_pb2

__all__ = ["assemble"]


def _wanted(request: worker_pb2.GenerateRequest, max_bytes: int) -> list[tuple[str, int]]:
    """(field path, byte count) of every embeds tensor whose bytes follow the request, in segment order."""
    out: list[tuple[str, int]] = []
    total = 0
    for i, seg in enumerate(request.segments):
        if seg.WhichOneof("kind") != "embeds" or len(seg.embeds.data):
            continue
        info = tensors.DTYPES.get(seg.embeds.dtype)
        if info is None:
            continue  # refused by name when the request is read (tensors.to_numpy)
        path = f"segments[{i}].embeds"
        count = tensors.check_shape(tuple(int(d) for d in seg.embeds.shape), f"{path}.shape")
        size = count * info.numpy.itemsize
        total += size
        if total > max_bytes:
            raise InvalidArgument(
                f"{path}.shape: the embedding rows of this request need {total} bytes or more; at most {max_bytes} "
                f"are accepted", field=f"{path}.shape", reason="TOO_LARGE")
        out.append((path, size))
    return out


async def assemble(messages: AsyncIterator[worker_pb2.GenerateChunk | wire.RowsPiece], max_bytes: int
                   ) -> tuple[worker_pb2.GenerateRequest, dict[str, memoryview]]:
    """The request of a GenerateChunks stream and its rows' bytes by field path (see the module docstring).
    ``messages`` as ``wire.parse_generate_chunk`` gives them: a rows-only message as a view of its bytes."""
    request: worker_pb2.GenerateRequest | None = None
    buffers: list[tuple[str, np.ndarray]] = []
    slot = 0
    filled = 0
    async for message in messages:
        part = "rows" if isinstance(message, wire.RowsPiece) else message.WhichOneof("part")
        if request is None:
            if part != "request":
                raise InvalidArgument("request: the first message of a GenerateChunks stream must be the request",
                                      field="request", reason="REQUIRED")
            request = message.request
            # 64-byte aligned (numpy's allocator), untouched until the bytes arrive
            buffers = [(path, np.empty(size, np.uint8)) for path, size in _wanted(request, max_bytes)]
            continue
        if part == "request":
            raise InvalidArgument("request: a GenerateChunks stream carries one request", field="request",
                                  reason="DUPLICATE")
        if part != "rows":
            continue  # an empty message: nothing to place
        # read once: each read of a protobuf bytes field copies
        piece = message.data if isinstance(message, wire.RowsPiece) else memoryview(message.rows)
        pos = 0
        while pos < len(piece):
            if slot == len(buffers):
                raise InvalidArgument(
                    f"rows: more bytes than the request's embeds tensors need "
                    f"({sum(b.size for _, b in buffers)})", field="rows", reason="TOO_MANY_BYTES")
            buf = buffers[slot][1]
            take = min(buf.size - filled, len(piece) - pos)
            buf[filled:filled + take] = np.frombuffer(piece, np.uint8, take, pos)
            filled += take
            pos += take
            if filled == buf.size:
                slot += 1
                filled = 0
    if request is None:
        raise InvalidArgument("request: the GenerateChunks stream ended before its request", field="request",
                              reason="REQUIRED")
    while slot < len(buffers) and buffers[slot][1].size == filled:
        slot += 1  # empty tensors need no bytes
        filled = 0
    if slot < len(buffers):
        need = sum(b.size for _, b in buffers)
        got = sum(b.size for _, b in buffers[:slot]) + filled
        raise InvalidArgument(f"rows: the stream ended after {got} of the {need} bytes the embeds tensors need",
                              field="rows", reason="INCOMPLETE")
    return request, {path: memoryview(buf) for path, buf in buffers}

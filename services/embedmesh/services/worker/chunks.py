"""``WorkerService.GenerateChunks`` on the worker: a Generate request whose embedding rows arrive in pieces after it
(``core/pieces.py`` has why, the stream's rules and its errors). The rows follow in segment order; they are laid
out once, aligned, and the request is then served by ``WorkerServicer.Generate`` unchanged: the same checks,
admission, engine and errors. Nothing past the worker's message size limit is allocated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from embedmesh.core import pieces, tensors, wire
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

__all__ = ["arrive"]


def _embeds(request: worker_pb2.GenerateRequest) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """The embeds tensors of a GenerateRequest by the field path ``messages.request_from_proto`` reads them with."""
    for i, seg in enumerate(request.segments):
        if seg.WhichOneof("kind") == "embeds":
            yield f"segments[{i}].embeds", seg.embeds


async def arrive(messages: AsyncIterator[worker_pb2.GenerateChunksRequest | wire.RowsPiece], max_bytes: int,
                 model_dtype: int) -> pieces.Arrival:
    """Every byte of a GenerateChunks stream, rows already in ``model_dtype`` NaN/Inf-checked piece by piece as they
    arrive (so that scan overlaps the transfer; ``messages.request_from_proto`` then skips it for them, see
    ``pieces.arriving``)."""
    def scan_for(request: worker_pb2.GenerateRequest) -> pieces.Scan | None:
        kinds = [t.dtype for _, t in _embeds(request) if not len(t.data) and t.dtype in tensors.DTYPES]
        if not kinds or any(k != model_dtype for k in kinds):
            return None
        return pieces.finite_scan(model_dtype, "prompt_embeds")

    arrival = await pieces.start(messages, _embeds, max_bytes, scan_for=scan_for)
    await arrival.finished()
    return arrival

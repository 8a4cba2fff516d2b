"""``WorkerService.GenerateChunks`` on the worker: a Generate request whose embedding rows arrive in pieces after it
(``core/pieces.py`` has why, the stream's rules and its errors). The rows follow in segment order; they are laid
out once, aligned, and the request is then served by ``WorkerServicer.Generate`` unchanged: the same checks,
admission, engine and errors. Nothing past the worker's message size limit is allocated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from embedmesh.core import pieces, wire
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

__all__ = ["assemble"]


def _embeds(request: worker_pb2.GenerateRequest) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """The embeds tensors of a GenerateRequest by the field path ``messages.request_from_proto`` reads them with."""
    for i, seg in enumerate(request.segments):
        if seg.WhichOneof("kind") == "embeds":
            yield f"segments[{i}].embeds", seg.embeds


async def assemble(messages: AsyncIterator[worker_pb2.GenerateChunksRequest | wire.RowsPiece], max_bytes: int
                   ) -> tuple[worker_pb2.GenerateRequest, dict[str, memoryview]]:
    """The request of a GenerateChunks stream and its rows' bytes by field path."""
    request, views = await pieces.assemble(messages, _embeds, max_bytes)
    return request, views

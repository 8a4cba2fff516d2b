"""The preprocessor's side of ``WorkerService.GenerateChunks``: a prompt with many embedding rows goes to its worker
as the request, then the rows in pieces (``worker/chunks.py`` has why and the stream's rules).

A request whose rows add up to ``CHUNKED_MIN`` bytes or more is sent this way (``ChunkedBody``); smaller ones stay
one Generate message (or a frame on the worker's GenerateMany stream). Each piece is copied once, just before gRPC
sends it, instead of joining the whole request into one buffer first.

A stream the worker ended before reading it all, which grpc.aio reports as its own INTERNAL (a failed write)
instead of the worker's answer, is made again as one Generate call, which gets that answer (a refusal, a drain);
the pipeline handles it as it handles any Generate call's. The mesh ships from one version, so every worker serves
GenerateChunks: an UNIMPLEMENTED is a failure like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from embedmesh.core import wire
from embedmesh.core.errors import EmbedmeshError, answered_by_peer
from embedmesh.core.logs import get_logger
from embedmesh.worker.v1 import worker_pb2

if TYPE_CHECKING:
    from embedmesh.services.preprocessor.workers import WorkerHandle

__all__ = ["CHUNKED_MIN", "CHUNK_BYTES", "ChunkedBody", "ChunkedCall"]

log = get_logger(__name__)

CHUNKED_MIN = 1 << 20
"""Rows of at least this many bytes go as a GenerateChunks stream."""

CHUNK_BYTES = 1 << 20
"""Bytes of rows per message (what the bench's bare client-streaming limit sends, too)."""


@dataclass(frozen=True)
class ChunkedBody:
    """One generation's request without its rows (serialized, ``wire.chunked_segments``) and the rows. ``ready``:
    rows still arriving from the client (``core.pieces``): ``await ready(n)`` until their first ``n`` bytes arrived
    and passed the checks (it raises the client stream's error instead if that stream broke a rule)."""

    request: bytes
    rows: tuple[memoryview, ...]
    ready: Callable[[int], Awaitable[None]] | None = None

    @property
    def rows_bytes(self) -> int:
        return sum(len(v) for v in self.rows)

    def messages(self) -> Iterator[bytes] | AsyncIterator[bytes]:
        if self.ready is None:
            return wire.chunk_messages(self.request, self.rows, CHUNK_BYTES)
        return self._arriving_messages(self.ready)

    async def _arriving_messages(self, ready: Callable[[int], Awaitable[None]]) -> AsyncIterator[bytes]:
        """The messages, each piece sent as soon as it arrived from the client; a client stream that broke a rule
        ends this one short (the worker then refuses it as incomplete; the preprocessor answers with the client
        stream's own error)."""
        yield wire.chunk_request_message(self.request)
        for end, piece in wire.row_pieces(self.rows, CHUNK_BYTES):
            try:
                await ready(end)
            except EmbedmeshError:
                return
            yield wire.chunk_rows_message(piece)

    async def complete(self) -> None:
        """Until every row arrived (at once unless they are still arriving)."""
        if self.ready is not None:
            await self.ready(self.rows_bytes)

    def joined(self) -> bytes:
        """The same request as one Generate message (after ``complete``)."""
        req = worker_pb2.GenerateRequest.FromString(self.request)
        pieces = iter(self.rows)
        for seg in req.segments:
            if seg.WhichOneof("kind") == "embeds":
                seg.embeds.data = bytes(next(pieces))
        return req.SerializeToString()


def _refused_while_writing(e: grpc.aio.AioRpcError) -> bool:
    """grpc.aio's own INTERNAL for a write that failed because the call had already ended: the worker answered
    before it read every piece (a refusal, a drain), and grpc.aio reports its failed write instead of that answer.
    The same request as one Generate call gets the worker's own answer (which the pipeline then handles)."""
    return e.code() == grpc.StatusCode.INTERNAL and not answered_by_peer(e)


class ChunkedCall:
    """One generation sent as a GenerateChunks stream; iterated and cancelled like a Generate call."""

    def __init__(self, handle: WorkerHandle, body: ChunkedBody) -> None:
        self._handle = handle
        self._body = body
        self._fallen_back = False
        self._call: Any = handle.chunks_call(body)
        self._responses: Any = None
        self._received = False
        self._cancelled = False

    def __aiter__(self) -> ChunkedCall:
        return self

    async def _generate_call(self) -> Any:
        await self._body.complete()
        if self._cancelled:
            raise asyncio.CancelledError
        self._call = self._handle.generate_call(self._body.joined())
        return self._call

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        if self._responses is None:
            self._responses = self._call.__aiter__()
        try:
            response = await self._responses.__anext__()
        except grpc.aio.AioRpcError as e:
            if self._received or self._fallen_back or not _refused_while_writing(e):
                raise
            self._fallen_back = True
            self._responses = (await self._generate_call()).__aiter__()
            response = await self._responses.__anext__()
        self._received = True
        return response

    def cancel(self) -> bool:
        self._cancelled = True
        return bool(self._call.cancel()) if self._call is not None else False

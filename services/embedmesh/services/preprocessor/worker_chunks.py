"""Big prompts to a worker: the request, then its embedding rows in pieces, as the frames of a
``WorkerService.GenerateMany`` call of its own (``worker/many.py`` has the worker's side and the rules).

A request whose rows add up to ``thresholds.WORKER_PIECES_MIN`` bytes or more is sent this way (``ChunkedBody``): a
start frame whose embeds tensors carry no ``data``, then ``rows`` frames of ``thresholds.PIECE_BYTES``. Each piece is
copied once, just before gRPC sends it, instead of joining the whole request into one buffer first; the worker lays the
rows out once, aligned. Its own call keeps the worker's shared stream (small requests) free while the rows are written.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from embedmesh.core.errors import EmbedmeshError
from embedmesh.core.logs import get_logger
from embedmesh.core.transport import wire
from embedmesh.core.transport.thresholds import PIECE_BYTES

__all__ = ["ChunkedBody", "OWN_ID"]

log = get_logger(__name__)

OWN_ID = 1
"""The generation id on a GenerateMany call that carries one generation."""


@dataclass(frozen=True)
class ChunkedBody:
    """One generation's request without its rows (serialized, ``wire.chunked_segments``) and the rows. ``ready``:
    rows still arriving from the client (``transport.pieces``): ``await ready(n)`` until their first ``n`` bytes arrived
    and passed the checks (it raises the client stream's error instead if that stream broke a rule)."""

    request: bytes
    rows: tuple[memoryview, ...]
    ready: Callable[[int], Awaitable[None]] | None = None

    @property
    def rows_bytes(self) -> int:
        return sum(len(v) for v in self.rows)

    def messages(self, trace_context: dict[str, str]) -> Iterator[bytes] | AsyncIterator[bytes]:
        """The GenerateMany messages: the start frame of generation ``OWN_ID``, then its rows frames."""
        if self.ready is None:
            return self._messages(trace_context)
        return self._arriving_messages(self.ready, trace_context)

    def _messages(self, trace_context: dict[str, str]) -> Iterator[bytes]:
        yield wire.frame_start(OWN_ID, self.request, trace_context)
        for _, piece in wire.row_pieces(self.rows, PIECE_BYTES):
            yield wire.frame_rows(OWN_ID, piece)

    async def _arriving_messages(self, ready: Callable[[int], Awaitable[None]], trace_context: dict[str, str]
                                 ) -> AsyncIterator[bytes]:
        """The messages, each piece sent as soon as it arrived from the client; a client stream that broke a rule
        ends this one short (the worker then refuses it as incomplete; the preprocessor answers with the client
        stream's own error)."""
        yield wire.frame_start(OWN_ID, self.request, trace_context)
        for end, piece in wire.row_pieces(self.rows, PIECE_BYTES):
            try:
                await ready(end)
            except EmbedmeshError:
                return
            yield wire.frame_rows(OWN_ID, piece)

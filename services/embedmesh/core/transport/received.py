"""A request as its server received it, and its tensors as explicit values.

A prompt's rows may travel apart from the message that declares them: cut out of the received buffer by
``wire.split_*`` (a big one-message request: the message keeps the tensor's dtype and shape, the bytes stay a view
of what gRPC handed over), or sent after the header as ``rows`` (``pieces``: laid out in buffers of their own, and,
when checked as they land, usable before the last byte arrived). ``Received`` carries the message with those bytes
by field path; ``Received.tensor`` gives one tensor as a ``WireTensor`` — its header, its bytes, and whether they
are still arriving — the value the services hand on to the code that reads the rows. Nothing is looked up from the
call's context or by an array's address: a function that reads rows takes them as an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from embedmesh.core import tensors
from embedmesh.tensor.v1 import tensor_pb2

if TYPE_CHECKING:
    from embedmesh.core.transport.pieces import Arrival

__all__ = ["Received", "WireTensor", "Arriving"]


class Arriving(NamedTuple):
    """Tensor ``index`` of a pieces stream (``pieces.Arrival``) whose bytes are still arriving, each checked as it
    lands: ``wait(n)`` before reading the first ``n`` bytes (it raises the stream's error if the stream broke a
    rule)."""

    arrival: Arrival
    index: int

    @property
    def nbytes(self) -> int:
        return self.arrival.size(self.index)

    async def wait(self, n: int) -> None:
        await self.arrival.wait(self.index, n)


@dataclass(frozen=True)
class WireTensor:
    """One tensor as a request carried it: ``header`` (its dtype and shape; its ``data`` when the bytes came inside
    the message), ``data`` (the bytes when they travelled apart from the message), ``arriving`` (set when those
    bytes follow the message on a pieces stream that checks them as they land: wait for them before reading
    values)."""

    header: tensor_pb2.Tensor
    data: memoryview | None = None
    arriving: Arriving | None = None

    @property
    def scanned(self) -> bool:
        """Whether its bytes passed the pieces stream's scan as they landed (only such bytes carry an ``Arriving``
        mark, which stays once they all arrived): a reader that applies the scan's rule need not scan them again."""
        return self.arriving is not None

    def read(self, field: str) -> tuple[np.ndarray, int]:
        """The tensor as an array over its bytes (bf16 as uint16 bits) and its dtype, checked by name ``field``
        (dtype, shape, byte length; ``tensors.to_numpy``); no copy. While ``arriving``, the array's bytes are not
        all there yet: wait for them (``Arriving.wait``) before reading values."""
        return tensors.to_numpy(self.header, field=field, data=self.data)


@dataclass(frozen=True)
class Received:
    """A received request: ``message`` (a protobuf message whose tensors may lack their bytes) and those bytes by
    field path (``views``, e.g. ``prompt_embeds`` or ``messages[1].content[0]``). ``arrival``: the pieces stream
    still delivering some of them, checked as they land (None once every byte is there)."""

    message: Any
    views: Mapping[str, memoryview] = field(default_factory=dict)
    arrival: Arrival | None = None

    def tensor(self, path: str, header: tensor_pb2.Tensor) -> WireTensor:
        """The tensor at ``path`` whose header is ``header``, with its bytes if they travelled apart."""
        data = self.views.get(path)
        arriving = self.arrival.arriving(path) if self.arrival is not None and data is not None else None
        return WireTensor(header, data, arriving)

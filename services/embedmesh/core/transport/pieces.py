"""Requests whose tensors' bytes follow them in pieces: ``InferenceService.Generate`` (clients and the gateway send
big ``prompt_embeds`` this way; a small request is its header alone) and the ``rows`` frames of
``WorkerService.GenerateMany`` (the preprocessor sends big prompts to a worker this way; the worker reads the frames
itself and feeds each generation's bytes to its arrival: ``expect``, ``Arrival.feed``).

One 64 MiB message costs more than its bytes: grpc.aio hands a received message to Python as a bytes object per
slice joined into one (two passes over memory that is no longer in cache), the sender first builds the whole message,
and nothing can start before its last byte arrived. Sent as ~1 MiB pieces, each piece is copied while it is still in
cache, no message size limit needs raising, and the receiver copies each piece once more into rows it allocated
itself — aligned, so the NaN/Inf scan runs at full speed (a tensor cut out of a protobuf message starts wherever its
field happened to start).

The stream (both messages have ``oneof part { request = 1; bytes rows = 2; }``): first ``request``, whose tensors
that carry no ``data`` give their dtype and shape; then ``rows`` pieces holding those tensors' bytes in order, split
anywhere. ``assemble`` checks the stream and returns the request with the bytes as views by field path (a
``received.Received``), the way ``wire`` gives a one-message request's tensors, so the request is then served exactly
as the one-message method would serve it. A tensor that carries its own ``data`` is taken as it
is; one whose dtype is unknown expects no bytes here and is refused by name by the ordinary checks afterwards.

Refused with INVALID_ARGUMENT naming the field: a first message that is not a request (``request``, REQUIRED), a
second request (``request``, DUPLICATE), tensors declaring more bytes in all than ``max_bytes`` (``<path>.shape``,
TOO_LARGE), a shape out of range (``<path>.shape``, INVALID_SHAPE / BAD_RANK), more bytes than the shapes need
(``rows``, TOO_MANY_BYTES), the stream ending before they all arrived (``rows``, INCOMPLETE), a stream that sends
nothing for ``IDLE_SECONDS`` before its request or before its end (``request`` / ``rows``, IDLE_TIMEOUT: it would
hold its caller's admission slot and the allocated rows until the client's own deadline). Nothing is
allocated past the limit, and rows are allocated but not touched until their bytes arrive.

``start`` returns as soon as the request arrived (an ``Arrival``: the bytes go on arriving in the background, and
consumers ``wait`` for a prefix of a tensor); with a ``scan`` the bytes count as arrived only once checked, so
consumers may use them before the stream ends (the preprocessor forwards a big prompt to its worker this way:
``Arrival.received`` gives each such tensor with an ``Arriving`` mark, so the code that builds on its rows knows to
wait for them). ``assemble`` is ``start`` and then waiting for every byte.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import numpy as np

from embedmesh.core import tensors, tracebacks
from embedmesh.core.embeds import check_finite
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.transport import wire
from embedmesh.core.transport.received import Arriving, Received
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["assemble", "start", "expect", "Arrival", "finite_scan"]

Tensors = Callable[[Any], Iterable[tuple[str, tensor_pb2.Tensor]]]
"""The tensors of a request, in the order their bytes follow it, each with its field path."""


def _wanted(request: Any, tensors_of: Tensors, max_bytes: int,
            inline: dict[str, memoryview]) -> list[tuple[str, int, int]]:
    """(field path, byte count, element size) of every tensor whose bytes follow the request, in order; a tensor
    whose bytes came in the request (``data``, or cut out of it by ``wire`` into ``inline``) is not one."""
    out: list[tuple[str, int, int]] = []
    total = 0
    for path, tensor in tensors_of(request):
        if len(tensor.data) or path in inline:
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
        out.append((path, count * info.numpy.itemsize, info.numpy.itemsize))
    return out


Scan = Callable[[int, np.ndarray], None]
"""Checks the bytes of tensor ``i`` that just arrived (whole elements, as uint8), raising InvalidArgument."""


def finite_scan(dtype: int, field: str) -> Scan:
    """The NaN/Inf rule (``embeds.check_finite``, named ``field``) for tensors already in ``dtype``, as a scan."""
    numpy_dtype = tensors.numpy_dtype(dtype)

    def scan(index: int, data: np.ndarray) -> None:
        check_finite(data.view(numpy_dtype), dtype, field)

    return scan


class Arrival:
    """A pieces stream whose request has arrived and whose tensors' bytes are read in the background: consumers
    wait for a prefix of a tensor (``wait``) instead of the whole stream, so what the bytes feed (forwarding them
    to a worker) overlaps their arrival. With ``scan``, a tensor's bytes count as arrived only once scanned, so no
    consumer ever sees bytes that break its rule. The first broken rule ends the arrival: every waiter gets it, and
    the arrival lets go of its buffers and views at once (``_fail``: its error keeps no traceback, whose frames would
    hold the arrival in a cycle until a full garbage collection)."""

    def __init__(self, request: Any, buffers: list[tuple[str, np.ndarray]], itemsizes: list[int],
                 scan: Scan | None) -> None:
        self.request = request
        self.buffers = buffers
        self.views: dict[str, memoryview] = {path: memoryview(buf) for path, buf in buffers}
        self._index = {path: i for i, (path, _) in enumerate(buffers)}
        self._sizes = [buf.size for _, buf in buffers]
        self._itemsizes = itemsizes
        self._scan = scan
        self._ready = [0] * len(buffers)
        """Bytes of each tensor that arrived (and passed ``scan``), from its start."""
        self._changed = asyncio.Event()
        self.error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._slot = 0
        """The tensor the next byte goes to, and how many of its bytes are placed."""
        self._filled = 0

    @property
    def scanned(self) -> bool:
        """Whether the bytes are checked as they arrive (then consumers may use them before the stream ends)."""
        return self._scan is not None

    def size(self, index: int) -> int:
        """Bytes tensor ``index`` needs."""
        return self._sizes[index]

    def arriving(self, path: str) -> Arriving | None:
        """Tensor ``path`` as still arriving, when its bytes follow the request and are checked as they land (else
        None: its bytes came with the request, or they are used only once every byte arrived)."""
        index = self._index.get(path)
        if index is None or self._scan is None or not self._sizes[index]:
            return None
        return Arriving(self, index)

    def received(self) -> Received:
        """The request with its tensors' bytes by field path (those that came with it and those that follow), the
        ones still arriving marked so when they are checked as they land."""
        return Received(self.request, self.views, self if self._scan is not None else None)

    def _raise(self) -> None:
        """Raise the arrival's error as a copy of its own: each waiter's frames join that copy's traceback, not the
        stored error's (which would then hold them, and through them the arrival, in a cycle)."""
        assert self.error is not None
        try:
            error = copy.copy(self.error)
        except Exception:  # noqa: BLE001 - an error that cannot be copied is raised as it is
            error = self.error
        raise error.with_traceback(None)

    async def wait(self, index: int, n: int) -> None:
        """Until the first ``n`` bytes of tensor ``index`` arrived; raises the arrival's error if it failed."""
        while self._ready[index] < n:
            if self.error is not None:
                self._raise()
            if self._task is not None and self._task.done():
                raise ValueError(f"tensor {index} has {self._sizes[index]} bytes, not {n}")
            await self._changed.wait()

    async def finished(self) -> None:
        """Until the stream ended with every byte the tensors need; raises the arrival's error if it failed. A
        caller cancelled while waiting stops the reading too."""
        if self._task is not None:
            try:
                await asyncio.shield(self._task)
            except asyncio.CancelledError:
                self._task.cancel()
                raise
        if self.error is not None:
            self._raise()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _fail(self, error: BaseException) -> None:
        """End the arrival with ``error`` (kept for every waiter, without the frames it passed through) and let go
        of the buffers: nothing will read them."""
        self.error = tracebacks.drop(error)
        self.buffers, self.views, self._index = [], {}, {}

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _advance(self, index: int, filled: int) -> None:
        size = self._itemsizes[index]
        end = filled - filled % size if filled < self._sizes[index] else filled
        if end > self._ready[index]:
            if self._scan is not None:
                self._scan(index, self.buffers[index][1][self._ready[index]:end])
            self._ready[index] = end

    async def _read(self, messages: AsyncIterator[Any]) -> None:
        try:
            await self._place(messages)
        except asyncio.CancelledError:
            self._fail(InvalidArgument("rows: the stream was cancelled", field="rows", reason="INCOMPLETE"))
            raise
        except BaseException as e:  # noqa: BLE001 - kept for every waiter; the owner raises it
            self._fail(e)
        finally:
            self._pulse()

    async def _place(self, messages: AsyncIterator[Any]) -> None:
        it = messages.__aiter__()
        while True:
            try:
                message = await _next(it, "rows")  # silence is bounded until the stream ends, bytes owed or not
            except StopAsyncIteration:
                break
            part = ("rows" if isinstance(message, wire.RowsPiece) else "request"
                    if isinstance(message, Received) else message.WhichOneof("part"))
            if part == "request":
                raise InvalidArgument("request: the stream carries one request", field="request",
                                      reason="DUPLICATE")
            if part != "rows":
                continue  # an empty message: nothing to place
            # read once: each read of a protobuf bytes field copies
            self._put(message.data if isinstance(message, wire.RowsPiece) else memoryview(message.rows))
            self._pulse()
        self._check_complete()

    def _complete(self) -> bool:
        """Every byte the tensors need has been placed (the slot moved past empty tensors first: they need none)."""
        while self._slot < len(self._sizes) and self._sizes[self._slot] == self._filled:
            self._slot += 1
            self._filled = 0
        return self._slot == len(self._sizes)

    def _put(self, piece: memoryview | bytes) -> None:
        """Place ``piece`` after the bytes placed so far (scanned as it lands); TOO_MANY_BYTES past the shapes."""
        buffers = self.buffers
        pos = 0
        while pos < len(piece):
            if self._slot == len(buffers):
                raise InvalidArgument(
                    f"rows: more bytes than the request's tensors need ({sum(self._sizes)})",
                    field="rows", reason="TOO_MANY_BYTES")
            buf = buffers[self._slot][1]
            take = min(buf.size - self._filled, len(piece) - pos)
            buf[self._filled:self._filled + take] = np.frombuffer(piece, np.uint8, take, pos)
            self._filled += take
            pos += take
            self._advance(self._slot, self._filled)
            if self._filled == buf.size:
                self._slot += 1
                self._filled = 0

    def _check_complete(self) -> None:
        if not self._complete():
            need = sum(self._sizes)
            got = sum(self._sizes[:self._slot]) + self._filled
            raise InvalidArgument(
                f"rows: the stream ended after {got} of the {need} bytes the request's tensors need",
                field="rows", reason="INCOMPLETE")

    # --- fed by a caller that reads the stream itself (``expect``) ---------------------------------------------
    def feed(self, piece: memoryview | bytes) -> None:
        """The next bytes of the tensors, from a stream read elsewhere (``expect``); a broken rule (too many bytes,
        the scan) ends the arrival with it, and raises it."""
        if self.error is not None:
            self._raise()
        try:
            self._put(piece)
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._pulse()

    def end(self) -> None:
        """The stream that fed the bytes ended: INCOMPLETE unless every byte arrived."""
        if self.error is None:
            try:
                self._check_complete()
            except InvalidArgument as e:
                self._fail(e)
        self._pulse()

    async def fed(self) -> None:
        """Until every byte was fed (``feed``); raises the arrival's error, or IDLE_TIMEOUT naming ``rows`` when no
        byte came for ``IDLE_SECONDS``."""
        while not self._complete():
            if self.error is not None:
                self._raise()
            changed = self._changed
            try:
                async with asyncio.timeout(IDLE_SECONDS):
                    await changed.wait()
            except TimeoutError:
                self._fail(InvalidArgument(
                    f"rows: nothing arrived for {IDLE_SECONDS:g} s and the rows are not complete; send every row "
                    "without pauses", field="rows", reason="IDLE_TIMEOUT"))
        if self.error is not None:
            self._raise()


def expect(request: Any, tensors_of: Tensors, max_bytes: int, scan: Scan | None = None) -> Arrival | None:
    """The arrival of ``request``'s tensors whose bytes follow it on a stream its caller reads (``Arrival.feed``,
    ``Arrival.end``, ``Arrival.fed``), allocated (nothing past ``max_bytes``, refused by name) but untouched; None
    when every tensor carries its bytes."""
    wanted = _wanted(request, tensors_of, max_bytes, {})
    if not wanted:
        return None
    return Arrival(request, [(path, np.empty(size, np.uint8)) for path, size, _ in wanted],
                   [itemsize for _, _, itemsize in wanted], scan)


async def start(messages: AsyncIterator[Any], tensors_of: Tensors, max_bytes: int,
                scan_for: Callable[[Any], Scan | None] | None = None) -> Arrival:
    """Read a pieces stream's request, allocate its tensors (nothing past ``max_bytes``) and go on reading their
    bytes in the background (see ``Arrival``). ``messages`` as ``wire.parse_chunk`` gives them: a first message
    whose inline tensors were cut out (a ``Received``) has those bytes in ``Arrival.views`` too.
    ``scan_for(request)`` may return the check each tensor's bytes pass as they arrive (``Arrival.scanned`` says
    whether it did); it is asked only when some bytes follow the request."""
    it = messages.__aiter__()
    try:
        first = await _next(it, "request")
    except StopAsyncIteration:
        raise InvalidArgument("request: the stream ended before its request", field="request",
                              reason="REQUIRED") from None
    inline: dict[str, memoryview] = {}
    if isinstance(first, Received):
        first, inline = first.message, dict(first.views)
    if isinstance(first, wire.RowsPiece) or first.WhichOneof("part") != "request":
        raise InvalidArgument("request: the first message of the stream must be the request", field="request",
                              reason="REQUIRED")
    request = first.request
    wanted = _wanted(request, tensors_of, max_bytes, inline)
    # 64-byte aligned (numpy's allocator), untouched until the bytes arrive
    arrival = Arrival(request, [(path, np.empty(size, np.uint8)) for path, size, _ in wanted],
                      [itemsize for _, _, itemsize in wanted], scan_for(request) if scan_for and wanted else None)
    arrival.views.update(inline)
    arrival._task = asyncio.ensure_future(arrival._read(it))
    return arrival


async def assemble(messages: AsyncIterator[Any], tensors_of: Tensors, max_bytes: int) -> Received:
    """The request of a pieces stream with its tensors' bytes by field path, once every byte arrived (see the
    module docstring). ``messages`` as ``wire.parse_chunk`` gives them: a rows-only message as a view of its bytes."""
    arrival = await start(messages, tensors_of, max_bytes)
    await arrival.finished()
    return Received(arrival.request, arrival.views)


IDLE_SECONDS = 30.0
"""How long a pieces stream may send nothing while its request or bytes are still owed."""


async def _next(it: AsyncIterator[Any], field: str) -> Any:
    """The stream's next message, or IDLE_TIMEOUT naming ``field`` after ``IDLE_SECONDS`` of silence."""
    try:
        async with asyncio.timeout(IDLE_SECONDS):
            return await it.__anext__()
    except TimeoutError:
        raise InvalidArgument(f"{field}: nothing arrived for {IDLE_SECONDS:g} s "
                              f"{'before the request' if field == 'request' else 'and the stream did not end'}; "
                              "send the whole stream without pauses, then close it", field=field,
                              reason="IDLE_TIMEOUT") from None

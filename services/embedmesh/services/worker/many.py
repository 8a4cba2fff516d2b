"""``WorkerService.GenerateMany``, the worker's one generation RPC: generations over a stream of start / rows /
cancel frames.

A gRPC call costs far more than a message on an open stream (grpc.aio's call set-up, the client interceptors, the
server's handler task): the preprocessor keeps one GenerateMany stream per worker and sends each small request on
it as one start frame. A big prompt gets a stream of its own: a start frame whose embeds tensors carry no ``data``,
then ``rows`` frames with their bytes (``transport.pieces.expect``: laid out once, aligned, NaN/Inf-scanned piece by
piece as they arrive; nothing past the worker's message size limit allocated). Its generation starts once every
byte arrived. Each generation has its own checks and admission (``WorkerServicer.generate``), its own span parented
by the frame's trace context and its own ``embedmesh_rpc_*{method="GenerateMany.generation"}`` counts; its error
ends only that generation, as an error result carrying the status (code, message, details).

Rows rules (INVALID_ARGUMENT naming ``rows``, as an error result of that id): rows for an id that is not running
(UNKNOWN_GENERATION), more bytes than the shapes need (TOO_MANY_BYTES: the generation ends), fewer when the request
stream ends (INCOMPLETE) or nothing for ``pieces.IDLE_SECONDS`` (IDLE_TIMEOUT).

Results of all generations share one outgoing queue, written as one ``GenerateManyResponse`` message per write: while
the caller reads slower than the engines produce, each write carries more results instead of the queue growing
message by message. Past ``BACKLOG`` waiting results, the generations and the frame reader pause (gRPC's flow
control then holds the caller back).

Ending: the caller's end of the request stream lets the running generations finish, then the stream ends. A
draining worker (``start_drain``) answers new generations UNAVAILABLE ``WORKER_DRAINING`` (the preprocessor retries
them elsewhere) and ends the stream as soon as its running generations are done, so the drain does not wait for the
caller to hang up. A cancelled stream (the caller went away) cancels every generation on it, which aborts them in
the engine.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from embedmesh.core import tracebacks
from embedmesh.core.errors import EmbedmeshError, InvalidArgument, Unavailable, to_status_message
from embedmesh.core.logs import get_logger
from embedmesh.core.server import Observed
from embedmesh.core.transport import pieces
from embedmesh.core.transport.wire import RowsFrame
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

__all__ = ["GENERATE_METHOD", "ManyStreams", "error_result", "embeds_of"]

log = get_logger(__name__)

GENERATE_METHOD = "/embedmesh.worker.v1.WorkerService/GenerateMany.generation"
"""What one generation is observed as (span name, RPC metrics: method ``GenerateMany.generation``)."""

BACKLOG = 4096
"""Results waiting to be written past which generations and the frame reader pause."""

_END = worker_pb2.GenerationEnd()

Generate = Callable[[worker_pb2.GenerateRequest, "pieces.Arrival | None"], AsyncIterator[worker_pb2.GenerateResponse]]
"""One generation: its request and, when its rows came as ``rows`` frames, their arrival (complete)."""

Expect = Callable[[worker_pb2.GenerateRequest], "pieces.Arrival | None"]
"""The arrival a start frame's rows-less tensors wait for (``pieces.expect``), or None."""


def embeds_of(request: worker_pb2.GenerateRequest) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """The embeds tensors of a GenerateRequest by the field path ``messages.request_from_proto`` reads them with."""
    for i, seg in enumerate(request.segments):
        if seg.WhichOneof("kind") == "embeds":
            yield f"segments[{i}].embeds", seg.embeds


def error_result(gid: int, err: EmbedmeshError) -> worker_pb2.GenerateResult:
    """The result that ends generation ``gid`` with ``err``'s status, details included."""
    return worker_pb2.GenerateResult(id=gid, error=to_status_message(err))


class _Stream:
    """One GenerateMany call: its running generations and its outgoing results."""

    def __init__(self, generate: Generate, draining: Callable[[], bool], expect: Expect) -> None:
        self._generate = generate
        self._draining = draining
        self._expect = expect
        self.running: dict[int, asyncio.Task[None]] = {}
        self.arrivals: dict[int, pieces.Arrival] = {}
        """Generations started with rows to come, until they all came (then the generation runs)."""
        self.out: list[worker_pb2.GenerateResult] = []
        self.wake = asyncio.Event()
        self.space = asyncio.Event()
        self.space.set()
        self.reading = True
        self.failed: BaseException | None = None

    def emit(self, result: worker_pb2.GenerateResult) -> None:
        self.out.append(result)
        if len(self.out) >= BACKLOG:
            self.space.clear()
        self.wake.set()

    async def results(self, frames: AsyncIterator[worker_pb2.GenerateManyRequest]) -> AsyncIterator[
            worker_pb2.GenerateManyResponse]:
        reader = asyncio.ensure_future(self._read(frames))
        try:
            while True:
                if self.out:
                    batch, self.out = self.out, []
                    self.space.set()
                    yield worker_pb2.GenerateManyResponse(results=batch)
                    continue
                if self.failed is not None:
                    raise self.failed
                if not self.running and (not self.reading or self._draining()):
                    return
                self.wake.clear()
                await self.wake.wait()
        finally:
            reader.cancel()
            for task in list(self.running.values()):
                task.cancel()
            await asyncio.gather(reader, *self.running.values(), return_exceptions=True)
            self.failed = None  # (its traceback holds _read's frame, which holds this stream: a cycle)

    async def _read(self, frames: AsyncIterator[worker_pb2.GenerateManyRequest]) -> None:
        try:
            async for message in frames:
                if isinstance(message, RowsFrame):  # one rows frame, its bytes uncopied (core.transport.wire)
                    self._on_rows(message.id, message.data)
                else:
                    for frame in message.frames:
                        self._on_frame(frame)
                if not self.space.is_set():
                    await self.space.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - a malformed message ends the stream with its error
            self.failed = e
        finally:
            self.reading = False
            if self.failed is None:  # (a broken stream fails as a whole: its generations are cancelled)
                for arrival in self.arrivals.values():
                    arrival.end()  # rows still owed: INCOMPLETE
            self.wake.set()

    def _on_rows(self, gid: int, data: memoryview | bytes) -> None:
        arrival = self.arrivals.get(gid)
        if arrival is not None:
            try:
                arrival.feed(data)  # a broken rule ends the arrival: its generation fails with it
            except EmbedmeshError as e:
                tracebacks.drop(e)  # the arrival keeps it: this frame (the rows) must not stay in its traceback
            return
        task = self.running.get(gid)
        if task is None:
            self.emit(error_result(gid, InvalidArgument(
                f"rows: generation {gid} is not running on this stream (rows follow its start frame)", field="rows",
                reason="UNKNOWN_GENERATION")))
            return
        # Running, and every byte its tensors need already came (or none were owed): the bytes are too many.
        self.running.pop(gid)
        task.cancel()
        self.emit(error_result(gid, InvalidArgument(
            f"rows: generation {gid} has every byte its tensors need; these {len(data)} are too many", field="rows",
            reason="TOO_MANY_BYTES")))

    def _on_frame(self, frame: worker_pb2.GenerateFrame) -> None:
        gid = frame.id
        action = frame.WhichOneof("action")
        if action == "rows" and gid:
            self._on_rows(gid, memoryview(frame.rows))
        elif gid == 0:
            self.emit(error_result(0, InvalidArgument("frames[].id must be >= 1", field="id",
                                                      reason="OUT_OF_RANGE")))
        elif action == "cancel":
            task = self.running.get(gid)
            if task is not None:
                task.cancel()
        elif action is None:
            self.emit(error_result(gid, InvalidArgument(
                f"frame {gid}: one of generate, rows or cancel is required", field="action", reason="REQUIRED")))
        elif gid in self.running:
            self.emit(error_result(gid, InvalidArgument(
                f"frame {gid}: a generation with this id is already running on this stream", field="id",
                reason="DUPLICATE_ID")))
        elif self._draining():
            self.emit(error_result(gid, Unavailable(
                "the worker is shutting down; retry on another worker", reason="WORKER_DRAINING",
                retry_after_seconds=1.0)))
        else:
            trace = list(frame.trace_context.items())
            try:
                arrival = self._expect(frame.generate)
            except EmbedmeshError as e:  # its tensors' shapes: refused before anything is allocated
                self.emit(error_result(gid, e))
                return
            if arrival is not None:
                self.arrivals[gid] = arrival
            self.running[gid] = asyncio.ensure_future(self._generation(gid, frame.generate, trace, arrival))

    async def _generation(self, gid: int, request: worker_pb2.GenerateRequest, trace: list[tuple[str, str]],
                          arrival: pieces.Arrival | None) -> None:
        try:
            with Observed(GENERATE_METHOD, trace) as obs:
                try:
                    if arrival is not None:
                        try:
                            await arrival.fed()
                        finally:
                            self.arrivals.pop(gid, None)
                    async for response in self._generate(request, arrival):
                        self.emit(worker_pb2.GenerateResult(id=gid, response=response))
                        if not self.space.is_set():
                            await self.space.wait()
                    self.emit(worker_pb2.GenerateResult(id=gid, end=_END))
                except Exception as e:  # noqa: BLE001 - as for a call: its status, or INTERNAL with an incident
                    self.emit(error_result(gid, obs.failed(e)))
        finally:
            self.running.pop(gid, None)
            self.wake.set()


class ManyStreams:
    """The worker's GenerateMany streams: serves each one and ends them all when a drain starts."""

    def __init__(self, generate: Generate, expect: Expect) -> None:
        self._generate = generate
        self._expect = expect
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self.draining = False

    async def serve(self, frames: AsyncIterator[worker_pb2.GenerateManyRequest]) -> AsyncIterator[
            worker_pb2.GenerateManyResponse]:
        stream = _Stream(self._generate, lambda: self.draining, self._expect)
        self._streams.add(stream)
        async for batch in stream.results(frames):
            yield batch

    async def start_drain(self) -> None:
        """Refuse new generations from now on; each stream ends once its running generations are done."""
        self.draining = True
        for stream in list(self._streams):
            stream.wake.set()

    def open_streams(self) -> int:
        return len(self._streams)

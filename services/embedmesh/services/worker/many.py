"""``WorkerService.GenerateMany``: many generations over one long-lived stream.

A gRPC call costs far more than a message on an open stream (grpc.aio's call set-up, the client interceptors, the
server's handler task): the preprocessor keeps one GenerateMany stream per worker and sends each small request on
it as one frame. Each generation is still handled as a ``Generate`` call would be — the same checks and admission
(``WorkerServicer.Generate`` runs it), its own span parented by the frame's trace context, its own
``embedmesh_rpc_*{method="Generate"}`` counts — and its error ends only that generation, as an error result carrying
the status (code, message, details) the call would have ended with.

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
from collections.abc import AsyncIterator, Callable

from embedmesh.core.errors import EmbedmeshError, InvalidArgument, Unavailable, to_status_message
from embedmesh.core.logs import get_logger
from embedmesh.core.server import Observed
from embedmesh.worker.v1 import worker_pb2

__all__ = ["GENERATE_METHOD", "ManyStreams", "error_result"]

log = get_logger(__name__)

GENERATE_METHOD = "/embedmesh.worker.v1.WorkerService/Generate"
"""What one generation is observed as (span name, RPC metrics)."""

BACKLOG = 4096
"""Results waiting to be written past which generations and the frame reader pause."""

_END = worker_pb2.GenerationEnd()

Generate = Callable[[worker_pb2.GenerateRequest], AsyncIterator[worker_pb2.GenerateResponse]]


def error_result(gid: int, err: EmbedmeshError) -> worker_pb2.GenerateResult:
    """The result that ends generation ``gid`` with ``err``'s status, details included."""
    return worker_pb2.GenerateResult(id=gid, error=to_status_message(err))


class _Stream:
    """One GenerateMany call: its running generations and its outgoing results."""

    def __init__(self, generate: Generate, draining: Callable[[], bool]) -> None:
        self._generate = generate
        self._draining = draining
        self.running: dict[int, asyncio.Task[None]] = {}
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

    async def _read(self, frames: AsyncIterator[worker_pb2.GenerateManyRequest]) -> None:
        try:
            async for message in frames:
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
            self.wake.set()

    def _on_frame(self, frame: worker_pb2.GenerateFrame) -> None:
        gid = frame.id
        action = frame.WhichOneof("action")
        if gid == 0:
            self.emit(error_result(0, InvalidArgument("frames[].id must be >= 1", field="id",
                                                      reason="OUT_OF_RANGE")))
        elif action == "cancel":
            task = self.running.get(gid)
            if task is not None:
                task.cancel()
        elif action is None:
            self.emit(error_result(gid, InvalidArgument(
                f"frame {gid}: one of generate or cancel is required", field="action", reason="REQUIRED")))
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
            self.running[gid] = asyncio.ensure_future(self._generation(gid, frame.generate, trace))

    async def _generation(self, gid: int, request: worker_pb2.GenerateRequest, trace: list[tuple[str, str]]) -> None:
        try:
            with Observed(GENERATE_METHOD, trace) as obs:
                try:
                    async for response in self._generate(request):
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

    def __init__(self, generate: Generate) -> None:
        self._generate = generate
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self.draining = False

    async def serve(self, frames: AsyncIterator[worker_pb2.GenerateManyRequest]) -> AsyncIterator[
            worker_pb2.GenerateManyResponse]:
        stream = _Stream(self._generate, lambda: self.draining)
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

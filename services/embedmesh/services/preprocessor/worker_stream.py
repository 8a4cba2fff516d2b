"""The preprocessor's side of ``WorkerService.GenerateMany`` (``worker/many.py`` is the other side): one long-lived
stream per worker carrying many small generations (``WorkerStream``), and a call of its own for a big prompt or a
worker without a shared stream (``OwnGeneration``).

``WorkerStream.generate(body)`` returns a ``Generation``; it and ``OwnGeneration`` are used alike: iterate for
``GenerateResponse`` deltas, catch ``grpc.aio.AioRpcError`` (a generation's error result becomes one, with the
worker's status details, so retries and error mapping in ``pipeline.py`` need not know where it came from),
``cancel()`` when no longer wanted (a cancel frame, or cancelling the call, tells the worker to abort it).

The stream opens on first use and re-opens on the next generation after it ends. When it ends — the worker died
(transport error), drained (it ends its streams once idle) or refused the method — every generation still on it
fails with that status (UNAVAILABLE ``WORKER_DRAINING`` when the stream ended cleanly, and for the generations not
yet answered when the stream was cut as a frame was written — ``core.mux.CUT_WHILE_WRITING``), which the pipeline
retries on another worker when nothing was sent yet, and continues there when output was sent (``migration.py``).
The mesh ships from one version, so every worker serves GenerateMany: an UNIMPLEMENTED is a failure like any other.

The stream itself (one writer task batching frames, one reader task, opened from an empty context on a channel of
its own without client interceptors, the mesh token as call metadata) is ``core.mux.MuxSession``; each frame
carries its caller's trace context.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import propagate

from embedmesh.core.errors import Unavailable, rpc_error, rpc_error_from_status, to_status_message
from embedmesh.core.logs import get_logger
from embedmesh.core.mux import MuxSession, entry
from embedmesh.core.server import plain_mesh_channel
from embedmesh.worker.v1 import worker_pb2

__all__ = ["WorkerStream", "Generation", "OwnGeneration", "GENERATE_MANY"]

log = get_logger(__name__)

GENERATE_MANY = "/embedmesh.worker.v1.WorkerService/GenerateMany"

_FRAMES = worker_pb2.GenerateManyRequest.DESCRIPTOR.fields_by_name["frames"].number
_GENERATE = worker_pb2.GenerateFrame.DESCRIPTOR.fields_by_name["generate"].number

_ENDED = rpc_error_from_status(to_status_message(Unavailable(
    "the worker ended its generation stream (it is shutting down); retry on another worker",
    reason="WORKER_DRAINING", retry_after_seconds=1.0)))
"""What a generation still on a stream the worker ended cleanly fails with: a frame sent as the worker ended its
stream; the worker is draining, so the pipeline retries it elsewhere without counting the worker as lost."""

_CANCELLED = rpc_error(grpc.StatusCode.CANCELLED, "cancelled")


class _Results:
    """One generation's results as they arrive, iterated and cancelled like a ``Generate`` call: its responses queued,
    then its end (``StopAsyncIteration``) or its error (raised as a ``grpc.aio.AioRpcError``). Subclasses differ in
    how the next message comes (``_more``) and in how a cancel reaches the worker (``_stop``)."""

    def __init__(self, gid: int) -> None:
        self._gid = gid
        self._queue: collections.deque[worker_pb2.GenerateResponse] = collections.deque()
        self._done = False
        self._error: grpc.aio.AioRpcError | None = None
        self.answered = False
        """The worker answered something for this generation (it had started on it)."""

    def __aiter__(self) -> _Results:
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        while True:
            if self._queue:
                return self._queue.popleft()
            if self._done:
                if self._error is None:
                    raise StopAsyncIteration
                raise self._error
            await self._more()

    async def _more(self) -> None:
        """Wait until a result of this generation was delivered (or it ended)."""
        raise NotImplementedError

    def _deliver(self, result: worker_pb2.GenerateResult) -> None:
        self.answered = True
        kind = result.WhichOneof("result")
        if kind == "response":
            self._queue.append(result.response)
            self._wake()
        elif kind == "error":
            self._end(rpc_error_from_status(result.error))
        elif kind == "end":
            self._end(None)

    def _end(self, error: grpc.aio.AioRpcError | None) -> None:
        """The generation's last result: its end (None) or its error; only the first counts."""
        if self._done:
            return
        self._done = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        """Something was delivered (a waiting ``_more`` may return)."""

    def cancel(self) -> bool:
        """Stop the generation (no-op once it ended)."""
        if self._done:
            return False
        self._end(_CANCELLED)
        return self._stop()

    def _stop(self) -> bool:
        """Tell the worker the generation was cancelled."""
        raise NotImplementedError


class Generation(_Results):
    """One generation on a ``WorkerStream``: its results are delivered by the stream's reader task."""

    def __init__(self, session: _Session, gid: int) -> None:
        super().__init__(gid)
        self._session = session
        self._event = asyncio.Event()

    async def _more(self) -> None:
        self._event.clear()
        await self._event.wait()

    def _wake(self) -> None:
        self._event.set()

    def _end(self, error: grpc.aio.AioRpcError | None) -> None:
        super()._end(error)
        self._session.sinks.pop(self._gid, None)

    def _stop(self) -> bool:
        self._session.send(worker_pb2.GenerateFrame(id=self._gid, cancel=worker_pb2.CancelGeneration())
                           .SerializeToString())
        return True


class _Session:
    """One open GenerateMany call and the generations on it."""

    def __init__(self, open_call: Callable[[], Any]) -> None:
        self.sinks: dict[int, Generation] = {}
        self._ids = itertools.count(1)
        self._mux = MuxSession(open_call, self._on_message, self._on_end)

    @property
    def closed(self) -> bool:
        return self._mux.closed

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, frame: bytes) -> None:
        if not self._mux.closed:
            self._mux.send(entry(_FRAMES, frame))

    def _on_message(self, message: worker_pb2.GenerateManyResponse) -> None:
        for result in message.results:
            sink = self.sinks.get(result.id)
            if sink is not None:
                sink._deliver(result)

    def _on_end(self, error: grpc.aio.AioRpcError | None) -> None:
        for sink in list(self.sinks.values()):
            if error is None or (self._mux.cut_while_writing and not sink.answered):
                # Ended cleanly, or cut as a frame was written and this generation had no answer yet: the worker is
                # going away before starting it, so it fails as draining (retried elsewhere, not "lost").
                sink._end(_ENDED)
            else:
                sink._end(error)
        self.sinks.clear()

    def close(self) -> None:
        self._mux.close()


class OwnGeneration(_Results):
    """One generation on a GenerateMany call of its own (``messages``: its start frame, then any rows frames, with
    id ``worker_chunks.OWN_ID``); iterated and cancelled like a ``Generation``, its results read from the call by the
    iterating caller. After the generation's end the call is read to its end (the worker ends it once the request
    stream is closed and nothing runs); after its error the call is cancelled (rows may still be on their way)."""

    def __init__(self, call: Any, gid: int) -> None:
        super().__init__(gid)
        self._call = call
        self._it: Any = None

    async def _more(self) -> None:
        if self._it is None:
            self._it = self._call.__aiter__()
        try:
            message = await self._it.__anext__()
        except StopAsyncIteration:
            self._end(_ENDED)  # ended before its generation did: the worker drains
            return
        for result in message.results:
            if result.id == self._gid:
                self._deliver(result)
        if self._done:
            await self._finish()

    async def _finish(self) -> None:
        if self._error is not None:
            self._call.cancel()
            return
        try:
            async for _ in self._it:
                pass
        except grpc.aio.AioRpcError:
            pass  # the generation ended normally; how the call ended after it does not matter

    def _stop(self) -> bool:
        return bool(self._call.cancel())


class WorkerStream:
    """The GenerateMany stream to one worker (opened on first use, re-opened after it ended)."""

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self._channel, metadata = plain_mesh_channel(address, max_message_bytes)
        method = self._channel.stream_stream(GENERATE_MANY, request_serializer=None,
                                             response_deserializer=worker_pb2.GenerateManyResponse.FromString)
        self._open = lambda: method(metadata=metadata)
        self._session: _Session | None = None

    def generate(self, body: bytes) -> Generation:
        """Start a generation of ``body`` (a serialized GenerateRequest)."""
        session = self._session
        if session is None or session.closed:
            session = self._session = _Session(self._open)
        gid = session.next_id()
        generation = Generation(session, gid)
        session.sinks[gid] = generation
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        head = worker_pb2.GenerateFrame(id=gid, trace_context=carrier).SerializeToString()
        session.send(head + entry(_GENERATE, body))  # the frame's generate field: the request bytes as they are
        return generation

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        await self._channel.close()

"""One long-lived bidirectional call carrying many requests: the client side the mesh's multiplexed streams share
(``WorkerService.GenerateMany``, ``RouterService.RouteMany``).

A message on an open stream costs a fraction of a grpc.aio call (no call set-up, no client interceptors, no handler
task on the server), so a service that sends many small requests to one peer keeps one such stream to it. Requests
are encoded by the caller as entries of the stream's repeated request field (``entry``); ``send`` queues one and
a single writer task writes everything queued as one message — a write must never be cancelled together with the
request that made it, because grpc.aio cancels the whole call when a write is cancelled. A single reader task hands
each response message to ``on_message``; when the call ends (the peer ended it, failed, or ``close``),
``on_end`` gets the error (None for a clean end) and the session is ``closed``: the owner opens a new one for the
next request.

A write that meets a call the peer has just ended (it drained, or died) is refused by gRPC's core, and grpc.aio then
replaces the call's real status with INTERNAL "Internal error from Core". That is not an error of the peer: the
session reports it as UNAVAILABLE (``CUT_WHILE_WRITING``) and sets ``cut_while_writing``, so an owner can tell the
requests the peer never answered (retry them elsewhere) from those it had started on.

The call is opened from an empty context (it outlives the request that opened it: no request's trace context or
principal rides on it) on a channel without client interceptors (an intercepted stream writes through an extra
queue and task); credentials go as call metadata (``plain_mesh_channel``).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

import grpc

from embedmesh.core.errors import rpc_error
from embedmesh.core.transport.wire import varint

__all__ = ["MuxSession", "entry", "CUT_WHILE_WRITING"]

CUT_WHILE_WRITING = "the stream ended while a request was being written to it"

_CORE_REFUSED = "Internal error from Core"
"""The details grpc.aio gives a call whose write its core refused (the call had ended); see the module docstring."""


def entry(field: int, message: bytes) -> bytes:
    """``message`` (serialized) as one entry of repeated message field ``field``: entries concatenated make the
    repeated field of one request message."""
    return varint((field << 3) | 2) + varint(len(message)) + message


class MuxSession:
    """One open multiplexed call (see the module docstring)."""

    def __init__(self, open_call: Callable[[], Any], on_message: Callable[[Any], None],
                 on_end: Callable[[grpc.aio.AioRpcError | None], None]) -> None:
        self.closed = False
        self.cut_while_writing = False
        """The call ended while a write was refused: its status was lost (see the module docstring)."""
        self._pending: list[bytes] = []
        self._flush = asyncio.Event()
        self._on_message = on_message
        self._on_end = on_end
        self._task = asyncio.get_running_loop().create_task(self._run(open_call), context=contextvars.Context())

    def send(self, entry_bytes: bytes) -> None:
        """Queue one request entry; the writer sends it with whatever else waits."""
        self._pending.append(entry_bytes)
        self._flush.set()

    async def _run(self, open_call: Callable[[], Any]) -> None:
        try:
            call = open_call()
        except Exception as e:  # noqa: BLE001 - e.g. the channel is closed: every request on it fails, none hangs
            self.closed = True
            self._on_end(rpc_error(grpc.StatusCode.UNAVAILABLE,
                                   f"the stream could not be opened ({type(e).__name__})"))
            return
        reader = asyncio.ensure_future(self._read(call))
        try:
            while not reader.done():
                await self._flush.wait()
                self._flush.clear()
                if not self._pending:
                    continue
                batch = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
                self._pending.clear()
                await call.write(batch)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception:  # noqa: BLE001 - the call ended: its status reaches the reader; stop writing
            pass
        finally:
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, call: Any) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for message in call:
                self._on_message(message)
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() == grpc.StatusCode.INTERNAL and e.details() == _CORE_REFUSED:
                self.cut_while_writing = True
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, CUT_WHILE_WRITING)
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the stream was closed")
            raise
        finally:
            self.closed = True
            self._flush.set()
            self._on_end(error)

    def close(self) -> None:
        """Cancel the call; ``on_end`` runs with CANCELLED."""
        self.closed = True
        self._task.cancel()

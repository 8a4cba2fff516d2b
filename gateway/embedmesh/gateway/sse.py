"""Server-sent events fed by one gRPC server-streaming call, and the client-disconnect rule.

The rule: when the HTTP client goes away, the gRPC call to the preprocessor is cancelled at once — the
preprocessor then cancels its calls to the workers, which abort generation. ``DisconnectWatcher`` waits for
``http.disconnect`` on its own task and calls ``call.cancel()`` itself, so a pending ``call.read()`` ends
immediately (even before the first token, and even between tokens of a slow model). It does not depend on the
ASGI server's spec version: Starlette's ``StreamingResponse`` only listens for the disconnect under ASGI < 2.4,
and uvicorn silently drops writes to a closed connection, so a stream that relied on a failing ``send`` would
keep a worker generating until ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.metrics import DISCONNECTS

__all__ = ["CUT_BY_SHUTDOWN", "DONE", "DisconnectWatcher", "EventStream", "event"]

DONE = b"data: [DONE]\n\n"
_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_CUT_SEND_SECONDS = 1.0
"""How long the last event of a stream cut by shutdown may wait for a client that does not read."""

CUT_BY_SHUTDOWN = ApiError(
    503, "this gateway is shutting down and ended the stream before it finished; retry the request (another gateway "
    "replica, or this one once restarted, will serve it)", code="server_shutting_down", type_="server_error",
    retry_after=1)
"""The error a stream still open at the end of the gateway's drain grace ends with."""


def event(obj: Any) -> bytes:
    """One SSE event carrying a JSON object."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _cut_events(err: ApiError) -> bytes:
    """Chat and completion streams end a failure with an ``{"error": ...}`` event and ``[DONE]``."""
    return event(err.body()) + DONE


class DisconnectWatcher:
    """Cancels ``call`` as soon as the ASGI server reports that the client left.

    Start it only after the request body has been read: from then on the only message ``receive`` can yield is
    ``http.disconnect`` (uvicorn also sends it once the response is complete, when cancelling is harmless).
    """

    def __init__(self, receive: Receive, call: grpc.aio.Call | grpc.aio.UnaryUnaryCall) -> None:
        self.gone = False
        """True once the client disconnected (before the response was complete)."""
        self._call = call
        self._complete = False
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._complete:
            self.gone = True
            self._call.cancel()

    def complete(self) -> None:
        """The response is about to finish normally: a disconnect from now on is the normal end of the exchange."""
        self._complete = True

    def stop(self) -> None:
        self._task.cancel()


class EventStream(Response):
    """``text/event-stream`` response over ``events``; owns ``call`` and the watcher, and cancels the call when it
    ends for any reason (finished, client gone, server shutdown)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], call: grpc.aio.Call, watcher: DisconnectWatcher,
                 cut: Callable[[ApiError], bytes] = _cut_events) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(_HEADERS)
        self._events = events
        self._call = call
        self._watcher = watcher
        self._cut = cut
        """The stream's last bytes when the server's shutdown cuts it (the route's own error event shape)."""
        self.on_close: list[Callable[[], None]] = []
        """Called once when the stream ends (the app's in-flight gauge hangs here)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        left = False
        started = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True
            async for chunk in self._events:
                if self._watcher.gone:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                self._watcher.complete()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            left = True  # an ASGI >= 2.4 server reports the disconnect as a failing send
        except asyncio.CancelledError:
            # The watcher's call.cancel() makes a pending read raise CancelledError; a real cancellation of this
            # task (server shutdown) must go on propagating.
            if not self._watcher.gone:
                if started:
                    await self._end_cut(send)
                raise
        finally:
            self._watcher.stop()
            self._call.cancel()
            if left or self._watcher.gone:
                DISCONNECTS.inc()
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            for hook in self.on_close:
                hook()

    async def _end_cut(self, send: Send) -> None:
        """The drain grace ran out with this stream open: tell the client to retry, in the route's error shape, and
        end the body cleanly instead of leaving it a bare transport error. A client that does not read gets its
        connection closed as before."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_CUT_SEND_SECONDS):
                await send({"type": "http.response.body", "body": self._cut(CUT_BY_SHUTDOWN), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

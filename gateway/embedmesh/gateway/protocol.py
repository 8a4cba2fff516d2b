"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol (llhttp, in C) with the gateway's answers to
requests that are not valid HTTP.

Why httptools: uvicorn falls back to h11 (pure Python) when httptools is missing, and h11 moved a big body through
its receive buffer piece by piece, about a fifth of the gateway's CPU on a 64 MiB upload (profile in
``docs/perf/``). The parser answers what it refuses itself (a malformed request line, a control character in a
header, bad framing) before any route runs; uvicorn words that as a plain-text 400. Here it is an OpenAI error
body like every other refusal (``errors.ApiError``), and the header section has a size limit (llhttp has none):
past ``MAX_HEADER_BYTES`` the request is answered 431 instead of buffering headers without bound. After either
answer the connection closes gently (``_refuse``).

Slow clients hold a connection, and behind it an admission slot, for as long as they are let: the headers of a
request must arrive within ``HEADER_SECONDS`` of its first byte (or of the connection, for its first request), and a
body at ``BODY_MIN_BYTES_PER_SECOND`` on average after a ``BODY_SECONDS`` allowance; past either the request is
answered 408 ``request_timeout`` and the connection closed (uvicorn has neither bound: 200 connections sending a
header line every 5 s were all still open after 30 s, and a body trickling a byte every 3 s held its slot forever).
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from embedmesh.gateway.errors import ApiError

__all__ = ["GatewayHttpProtocol", "MAX_HEADER_BYTES", "LINGER_SECONDS", "LINGER_BYTES", "HEADER_SECONDS",
           "BODY_SECONDS", "BODY_MIN_BYTES_PER_SECOND"]

MAX_HEADER_BYTES = 64 * 1024
"""The request line and headers of one request, at most (bytes as received)."""
HEADER_SECONDS = 10.0
"""A request's line and headers arrive within this long of its first byte (a new connection's first request: of
the connection)."""
BODY_SECONDS = 30.0
BODY_MIN_BYTES_PER_SECOND = 16 * 1024
"""A body may take ``BODY_SECONDS`` plus one second per this many bytes received (128 kbit/s on average)."""
LINGER_SECONDS = 2.0
LINGER_BYTES = 1 << 20
"""After a refusal, the connection is closed once this long has passed or this much more has arrived."""


def _error_response(err: ApiError) -> bytes:
    """``err`` as a whole HTTP/1.1 response (the body every gateway refusal has), on a connection that closes."""
    body = orjson.dumps(err.body())
    return b"".join([
        b"HTTP/1.1 %d %s\r\n" % (err.status, HTTPStatus(err.status).phrase.encode()),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
        body,
    ])


class GatewayHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` answering unparseable requests with JSON and bounding the header section."""

    _received = 0  # bytes received while this request's headers are not complete
    _parsed = 0  # bytes of its URL, header names and values parsed
    _in_headers = True
    _too_large = False
    _ended = False  # a request ended within the data being parsed
    _refused = False  # answered 400/431/408: what still arrives is dropped
    _dropped = 0
    _deadline: asyncio.TimerHandle | None = None  # the header or body bound of the request being received
    _body_started = 0.0
    _body_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch(HEADER_SECONDS, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._watch(None)
        super().connection_lost(exc)

    def _watch(self, seconds: float | None, then: object = None) -> None:
        """(Re)arm the one deadline timer (``None``: disarm)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, then)  # type: ignore[arg-type]

    def _headers_late(self) -> None:
        self._deadline = None
        if self._in_headers and not self._refused and not self.transport.is_closing():
            self._refuse(ApiError(408, f"the request line and headers did not arrive within {HEADER_SECONDS:g} s; "
                                  "send them at once", code="request_timeout"))

    def _body_late(self) -> None:
        self._deadline = None
        allowed = BODY_SECONDS + self._body_bytes / BODY_MIN_BYTES_PER_SECOND
        left = self._body_started + allowed - self.loop.time()
        if left > 0:  # more arrived since the timer was set: the deadline moved
            self._watch(left, self._body_late)
            return
        if self._refused or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:  # nothing more can be said on this connection
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.close()
            return
        self._refuse(ApiError(408, f"the request body arrived slower than {BODY_MIN_BYTES_PER_SECOND // 1024} KiB/s "
                              f"after {BODY_SECONDS:g} s; send it at once", code="request_timeout"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._received = self._parsed = 0
        self._in_headers = True
        if self._deadline is None:  # a later request on a kept-alive connection: from its first byte
            self._watch(HEADER_SECONDS, self._headers_late)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._body_started, self._body_bytes = self.loop.time(), 0
        self._watch(BODY_SECONDS, self._body_late)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._ended = True
        self._watch(None)
        super().on_message_complete()

    def _count(self, n: int) -> None:
        self._parsed += n
        if self._parsed > MAX_HEADER_BYTES:
            self._too_large = True
            raise ValueError("headers over the limit")  # the parser stops; uvicorn calls send_400_response

    def data_received(self, data: bytes) -> None:
        if self._refused:  # after a refusal: read and drop what still comes (see ``_refuse``)
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        self._ended = False
        super().data_received(data)
        if self._in_headers and not self._refused and not self.transport.is_closing():
            # What was received since this request began is still its request line and headers (the parser has
            # not reached their end): one header that never ends is refused too. When a request ended within
            # this data (a pipelined one follows it), the part that began the next is not counted: at most one
            # read's worth of slack, never the earlier request's body taken for headers.
            self._received = 0 if self._ended else self._received + len(data)
            if self._received > MAX_HEADER_BYTES:
                self._too_large = True
                self.send_400_response("")

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this when the parser refuses the request (``msg`` is its fixed plain-text line).
        if self._too_large:
            self.logger.warning("request headers over the limit")
            self._refuse(ApiError(431, f"the request line and headers are over the {MAX_HEADER_BYTES} byte limit; "
                                  "send shorter headers (big values belong in the body)", code="headers_too_large"))
        else:
            self._refuse(ApiError(400, "the request is not valid HTTP/1.1 (its request line, a header or the body's "
                                  "framing is malformed); fix the request and send it again", code="invalid_http"))

    def _refuse(self, err: ApiError) -> None:
        """Answer, then close gently: our side ends (FIN after the answer) while what the client is still sending
        is read and dropped for up to ``LINGER_SECONDS`` / ``LINGER_BYTES``. Closing at once with unread bytes
        makes the kernel reset the connection, and a reset can destroy the answer before the client reads it."""
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # a route reading this body: it sees the client gone
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(_error_response(err))
        try:
            self.transport.write_eof()
        except (NotImplementedError, AttributeError, OSError, RuntimeError):  # TLS cannot half-close
            self.transport.close()
            return
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)

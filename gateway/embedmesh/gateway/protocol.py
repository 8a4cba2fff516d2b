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

Clients without a valid API key are capped per IP address (connections, requests in flight) and per connection
(pipelined requests): ``client_caps.py``; past a cap, 429 with ``Retry-After`` and the connection closes.

A request with a valid key whose tenant is at its share (requests in flight, requests per second:
``tenant_admission.py``) is answered 429 with ``Retry-After`` from its headers: no byte of its body is taken in,
no JSON parsed, no app task started (``_admit_tenant``). What then happens to its body: none (a GET) or a small
one (a declared ``Content-Length`` up to ``SKIP_BODY_BYTES``, no ``Expect: 100-continue``) is skipped by the parser
and the connection stays open for the next request, since a new connection (and its TLS handshake) costs more
than 64 KiB of parsing; anything else (a big or chunked body, or one the client holds back for ``100 Continue``)
gets the answer with ``Connection: close`` and the connection closes gently (``_refuse``): skipping it would mean
reading a body of any size, for nothing, and a client waiting for ``100 Continue`` would never send it at all.
This is a security rule, not a performance bypass: ``EMBEDMESH_FASTPATH=off`` leaves it on.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import weakref
from collections import deque
from http import HTTPStatus
from typing import Any

import httptools
import orjson
from starlette.routing import Match
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from embedmesh.core import auth
from embedmesh.gateway import client_caps
from embedmesh.gateway.auth import needs_key
from embedmesh.gateway.client_caps import ClientCaps
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.metrics import REQUESTS
from embedmesh.gateway.tenant_admission import TenantAdmission

__all__ = ["GatewayHttpProtocol", "MAX_HEADER_BYTES", "LINGER_SECONDS", "LINGER_BYTES", "HEADER_SECONDS",
           "BODY_SECONDS", "BODY_MIN_BYTES_PER_SECOND", "SKIP_BODY_BYTES"]

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
SKIP_BODY_BYTES = 64 * 1024
"""A refused keyed request's body is skipped (the connection kept) when it declares at most this many bytes."""


def _error_response(err: ApiError, close: bool = True) -> bytes:
    """``err`` as a whole HTTP/1.1 response (the body every gateway refusal has), on a connection that closes
    unless ``close`` is False."""
    body = orjson.dumps(err.body())
    return b"".join([
        b"HTTP/1.1 %d %s\r\n" % (err.status, HTTPStatus(err.status).phrase.encode()),
        *(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in err.headers().items()),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n" if close else b"\r\n",
        body,
    ])


class _ServerLimits:
    """What every connection of one uvicorn server shares, built once from the gateway's settings (the app's
    ``state.gateway.config``; the defaults when the app is not the gateway's): the caps for clients without a key
    and the tenants' admission."""

    def __init__(self, app: Any) -> None:
        settings = getattr(getattr(getattr(app, "state", None), "gateway", None), "config", None)
        self.caps = ClientCaps(getattr(settings, "anon_connections_per_ip", client_caps.CONNECTIONS_PER_IP),
                               getattr(settings, "anon_requests_per_ip", client_caps.REQUESTS_PER_IP),
                               idle=GatewayHttpProtocol._idle, close=GatewayHttpProtocol._evict)
        self.admission = TenantAdmission(getattr(settings, "max_inflight", 0), getattr(settings, "tenant_share", 1.0))
        self.metrics_require_key = bool(getattr(settings, "metrics_require_key", False))

    def admits(self, path: str) -> bool:
        """Whether the app's admission counts a request for ``path``: every route that needs a key but /metrics."""
        return path != "/metrics" and needs_key(path, self.metrics_require_key)


_LIMITS: weakref.WeakKeyDictionary[Any, _ServerLimits] = weakref.WeakKeyDictionary()
"""One ``_ServerLimits`` per uvicorn server (keyed by its ``ServerState``, which every connection it accepts is
handed): built at its first connection, then only read."""


def _limits_of(protocol: GatewayHttpProtocol) -> _ServerLimits:
    limits = _LIMITS.get(protocol.server_state)
    if limits is None:
        limits = _LIMITS[protocol.server_state] = _ServerLimits(protocol.config.app)
    return limits


def _route_of(app: Any, method: str, path: str) -> str | None:
    """The route of the app that serves ``method path`` (None: the app answers 404/405 without admission); every
    path is the app's own when it is not a Starlette app."""
    router = getattr(app, "router", None)
    if router is None:
        return path
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    for route in router.routes:
        if route.matches(scope)[0] is Match.FULL:
            return str(route.path)
    return None


def _too_many(what: str) -> ApiError:
    return ApiError(429, f"too many {what} from your address without a valid API key; retry later, or send "
                    "'Authorization: Bearer <key>'", code="rate_limit_exceeded", type_="rate_limit_error",
                    retry_after=1.0)


class _QuietLog:
    """uvicorn's logger for one connection, minus the warning it logs when the parser stops: when the protocol
    stopped it on purpose (a cap's 429), that is no invalid request, and a flood would be a flood of log lines."""

    def __init__(self, protocol: GatewayHttpProtocol, logger: Any) -> None:
        self._protocol = protocol
        self._logger = logger

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        if self._protocol._refusal is None:
            self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


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
    _caps: ClientCaps | None = None
    _ip = ""
    _keyed_only = False  # a connection past its IP's cap: only requests with a valid key are served
    _refusal: ApiError | None = None  # the answer to give when the parser is stopped on purpose
    _skipping = False  # the request being received was answered from its headers: its body is being skipped
    _limits: _ServerLimits | None = None  # what this connection's server shares among its connections
    _counted: deque[tuple[bool, str | None]]
    """Per request of this connection not yet answered: counted in the IP's requests; the tenant it is counted for."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.logger = _QuietLog(self, self.logger)  # type: ignore[assignment]
        self._counted = deque()
        self._watch(HEADER_SECONDS, self._headers_late)
        self._limits = _limits_of(self)
        if self.client:
            self._ip = client_caps.address_key(self.client[0])
            self._caps = self._limits.caps
            self._keyed_only = not self._caps.connected(self._ip, self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._leave()  # the connection goes to another protocol: this one never hears of it again
        super().handle_websocket_upgrade()

    def _leave(self) -> None:
        """Disarm the deadline and give back what this connection holds in the caps."""
        self._watch(None)
        if self._caps is not None:
            self._caps.forget(self._ip, self)
        while self._counted:
            self._release(*self._counted.popleft())

    def _release(self, anonymous: bool, tenant: str | None) -> None:
        """Give back what one answered request held: its IP's request, its tenant's slot."""
        if anonymous and self._caps is not None:
            self._caps.release_request(self._ip)
        if tenant is not None and self._limits is not None:
            self._limits.admission.leave(tenant)

    @staticmethod
    def _idle(conn: GatewayHttpProtocol) -> bool:
        """No request of ``conn`` is being served or queued (it is between requests, or in its headers)."""
        return not conn._counted and not conn.pipeline and (conn.cycle is None or conn.cycle.response_complete)

    @staticmethod
    def _evict(conn: GatewayHttpProtocol) -> None:
        """Close an idle connection to make room: a request begun on it is answered 429; between requests it just
        closes (as a keep-alive timeout would)."""
        if conn._refused or conn.transport.is_closing():
            return
        if conn._received or conn.cycle is None:
            conn._refuse(_too_many("connections"))
        else:
            conn._watch(None)
            conn.transport.close()

    def _admit_request(self) -> tuple[bool, auth.ApiKey | None]:
        """At a request's end of headers: a valid key takes its connection out of the caps (its key is returned);
        a request without one is counted for its IP (True: release it when answered), or refused (429) past a
        cap."""
        if not auth.keyring().enabled:
            return False, None
        key = client_caps.presented_key(self.headers)
        caps = self._caps
        if key is not None or caps is None:
            if caps is not None:
                caps.keyed(self._ip, self)
                self._keyed_only = False
            return False, key
        if self._keyed_only:
            self._stop(_too_many("connections"))
        if len(self.pipeline) >= client_caps.PIPELINE_DEPTH:
            self._stop(_too_many("pipelined requests on one connection"))
        taken = caps.take_request(self._ip)
        if taken is None:
            self._stop(_too_many("requests in flight"))
        return bool(taken), None

    def _admit_tenant(self, key: auth.ApiKey) -> tuple[str | None, ApiError | None]:
        """A keyed request's tenant admission, from its headers: (the tenant it is counted for, None when not
        counted; the refusal to answer now, or None). A route the app does not admit (``/health``, ``/metrics``,
        open routes) is neither counted nor refused; neither is a refusal sent for a request the app would answer
        404/405, nor for a pipelined one (answers go out in order: the app's own admission refuses it, and the
        preprocessor applies the rate)."""
        limits = self._limits
        path = httptools.parse_url(self.url).path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        if limits is None or not limits.admits(path):
            return None, None
        err = limits.admission.enter(key)
        if err is None:
            return key.tenant, None
        if self.cycle is not None and not self.cycle.response_complete:
            return None, None
        route = _route_of(self.config.app, self.parser.get_method().decode("latin-1"), path)
        if route is None:
            return None, None
        REQUESTS.labels(route, str(err.status)).inc()
        return None, err

    def _answer_early(self, err: ApiError) -> None:
        """Answer a request from its headers, its body unread: skipped when small (the connection stays), else the
        connection closes (see the module's docstring)."""
        length, declared = 0, False  # no Content-Length nor Transfer-Encoding: no body (a GET)
        for name, value in self.headers:
            if name == b"content-length":
                length = int(value) if value.isdigit() and not declared else -1
                declared = True
            elif name == b"transfer-encoding":
                length, declared = -1, True
        if not 0 <= length <= SKIP_BODY_BYTES or self.expect_100_continue or not self.parser.should_keep_alive():
            self._stop(err)
        self.cycle = RequestResponseCycle(
            scope=self.scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=False, default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(), expect_100_continue=False, keep_alive=True,
            on_response=self.on_response_complete)
        self.cycle.response_started = self.cycle.response_complete = True  # uvicorn drops the body's bytes
        self._skipping = bool(length)
        self.transport.write(_error_response(err, close=False))
        self.on_response_complete()

    def _stop(self, err: ApiError) -> None:
        """Stop the parser; uvicorn then calls ``send_400_response``, which gives ``err``."""
        self._refusal = err
        raise ValueError(err.message)

    def on_response_complete(self) -> None:
        if self._counted:
            self._release(*self._counted.popleft())
        super().on_response_complete()

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
        anonymous, key = self._admit_request()
        self._in_headers = False
        self._body_started, self._body_bytes = self.loop.time(), 0
        self._watch(BODY_SECONDS, self._body_late)
        tenant, err = self._admit_tenant(key) if key is not None else (None, None)
        self._counted.append((anonymous, tenant))
        if err is not None:
            self._answer_early(err)
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._ended = True
        self._watch(None)
        if self._skipping:  # answered before its body ended: the connection is idle from now on
            self._skipping = False
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
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
        if self._refused:  # answered already (a connection closed to make room)
            return
        if self._refusal is not None:
            self._refuse(self._refusal)
        elif self._too_large:
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

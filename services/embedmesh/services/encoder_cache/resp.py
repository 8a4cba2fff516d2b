"""A minimal RESP2 client for the encoder cache's bulk transfers: large values go straight between the socket and
the caller's memory.

redis-py (even with hiredis) copies every reply several times on the way in (socket -> stream buffer -> parser ->
one ``bytes`` per chunk -> the joined value) and that, not Redis, bounds an L2 read. Here a reply's bulk string can
be given a *sink*: a writable memoryview of exactly its length (a slice of the numpy array being filled), and the
kernel writes the body there (``asyncio.BufferedProtocol`` + ``recv_into``); only the short reply lines go through a
small scratch buffer. Requests are pipelined: every command of a call is written at once and the replies are read
in one pass, calling ``on_bulk`` as each bulk string completes (so a digest can run while the rest arrives).

Scope: plain TCP or unix sockets, optional AUTH and SELECT; one request at a time per connection; RESP2 only.
Errors: an error reply is returned as the exception redis-py would raise for it, as a value (``ResponseError`` for
OOM, READONLY ...; the connection stays usable);
anything else (connection lost or refused, malformed reply, the deadline passed) raises ``ConnectionError`` or
``TimeoutError`` and the connection is closed, never reused. A call that is cancelled midway closes it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis import exceptions

__all__ = ["DISCARD", "FILLED", "RespConnection", "RespPool", "plain_params"]

_SCRATCH = 1 << 16
_MAX_LINE = 1 << 16
_MAX_COLLECT = 1 << 20
"""Largest bulk string returned as ``bytes`` when no sink is given for it; a longer one is discarded."""
_INLINE = 1 << 14
_DISCARD_BUFFER = 1 << 21
"""A discarded bulk string up to this size is received in one throwaway buffer (few large reads), not the scratch."""
"""Arguments up to this size are copied into the request buffer; longer ones are written from the caller's memory."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DISCARD: Any = _Marker("DISCARD")
"""``sink_for`` answer: read this bulk string and throw it away (the reply value is DISCARD too)."""
FILLED: Any = _Marker("FILLED")
"""Reply value of a bulk string written into the sink it was given."""

SinkFor = Callable[[int, int], Any]
"""(bulk index in this call, length) -> a writable memoryview of exactly that length, DISCARD, or None (collect)."""
OnBulk = Callable[[int, Any], None]
"""(bulk index, value: bytes, None for a nil bulk, FILLED or DISCARD), called as each bulk string completes."""


class _Call:
    __slots__ = ("expected", "replies", "sink_for", "on_bulk", "bulks", "future", "stack")

    def __init__(self, expected: int, sink_for: SinkFor | None, on_bulk: OnBulk | None,
                 future: asyncio.Future[list[Any]]) -> None:
        self.expected = expected
        self.replies: list[Any] = []
        self.sink_for = sink_for
        self.on_bulk = on_bulk
        self.bulks = 0
        self.future = future
        self.stack: list[tuple[int, list[Any]]] = []


class _Protocol(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self._buf = bytearray(_SCRATCH)
        self._lo = 0
        self._hi = 0
        self._call: _Call | None = None
        self._sink: memoryview | None = None
        self._sink_pos = 0
        self._sink_index = 0
        self._sink_value: Any = FILLED  # what a filled sink is reported as (DISCARD for the throwaway buffer)
        self._trash: bytearray | None = None
        self._bulk: tuple[int, int] | None = None  # (index, length) of a bulk being collected into the scratch
        self._discard = -1  # bytes left to skip of a discarded bulk; -1 = not discarding
        self._discard_index = 0
        self._crlf = 0  # CRLF bytes still to consume after a bulk body

    # -- asyncio.BufferedProtocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionError("redis closed the connection")
        self._fail(ConnectionError(f"redis connection lost: {self.lost!r}"))

    def eof_received(self) -> bool:
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None:
            return self._sink[self._sink_pos:]
        if self._lo == self._hi:
            self._lo = self._hi = 0
        need = 4096
        if self._bulk is not None:
            need = max(need, self._bulk[1] + 2 - (self._hi - self._lo))
        if len(self._buf) - self._hi < need:
            live = self._hi - self._lo
            if len(self._buf) - live >= need:
                self._buf[:live] = self._buf[self._lo:self._hi]  # same size: allowed while views exist
            else:  # a new buffer, never a resize of one a view may still point at
                new = bytearray(max(2 * len(self._buf), live + need))
                new[:live] = self._buf[self._lo:self._hi]
                self._buf = new
            self._lo, self._hi = 0, live
        return memoryview(self._buf)[self._hi:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._sink is not None:
                self._sink_pos += nbytes
                if self._sink_pos < len(self._sink):
                    return
                self._sink = None
                self._crlf = 2
                self._emit_bulk(self._sink_index, self._sink_value)
            else:
                self._hi += nbytes
            self._parse()
        except Exception as e:  # noqa: BLE001 - a malformed reply or a failing callback: this connection is done
            self.abort(e if isinstance(e, ConnectionError) else ConnectionError(f"redis reply not understood: {e!r}"))

    # -- calls --------------------------------------------------------------------------------------------------
    def start(self, call: _Call) -> None:
        if self.lost is not None:
            raise ConnectionError(f"redis connection lost: {self.lost!r}")
        if self._call is not None:
            raise RuntimeError("one call at a time per connection")
        self._call = call

    def abort(self, err: BaseException) -> None:
        self._fail(err)
        if self.lost is None:
            self.lost = err
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, err: BaseException) -> None:
        call, self._call = self._call, None
        self._sink = None
        if call is not None and not call.future.done():
            call.future.set_exception(err)

    # -- parsing ------------------------------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        while self._call is not None and self._sink is None:
            if self._discard >= 0:
                take = min(self._discard, self._hi - self._lo)
                self._lo += take
                self._discard -= take
                if self._discard:
                    return
                self._discard = -1
                self._crlf = 2
                self._emit_bulk(self._discard_index, DISCARD)
                continue
            if self._crlf:
                if self._hi - self._lo < self._crlf:
                    return
                if buf[self._lo:self._lo + 2] != b"\r\n":
                    raise ConnectionError("bulk string not followed by CRLF")
                self._lo += 2
                self._crlf = 0
                self._maybe_done()
                continue
            if self._bulk is not None:
                index, length = self._bulk
                if self._hi - self._lo < length + 2:
                    return
                value = bytes(buf[self._lo:self._lo + length])
                self._lo += length
                self._bulk = None
                self._crlf = 2
                self._emit_bulk(index, value)
                continue
            end = buf.find(b"\r\n", self._lo, self._hi)
            if end < 0:
                if self._hi - self._lo > _MAX_LINE:
                    raise ConnectionError("reply line too long")
                return
            kind = buf[self._lo]
            line = bytes(buf[self._lo + 1:end])
            self._lo = end + 2
            if kind == 0x24:  # $ bulk string
                self._start_bulk(int(line))
            elif kind == 0x2A:  # * array
                n = int(line)
                if n <= 0:
                    self._emit(None if n < 0 else [])
                else:
                    self._call.stack.append((n, []))
            elif kind == 0x2B:  # + simple string
                self._emit(line.decode("utf-8", "replace"))
            elif kind == 0x2D:  # - error
                self._emit(_error(line.decode("utf-8", "replace")))
            elif kind == 0x3A:  # : integer
                self._emit(int(line))
            else:
                raise ConnectionError(f"unexpected reply type {chr(kind)!r}")
            self._maybe_done()

    def _start_bulk(self, length: int) -> None:
        call = self._call
        assert call is not None
        if length < 0:
            index = call.bulks
            call.bulks += 1
            self._emit_bulk(index, None)
            return
        index = call.bulks
        call.bulks += 1
        sink = call.sink_for(index, length) if call.sink_for is not None else None
        if sink is None and length > _MAX_COLLECT:
            sink = DISCARD
        value = FILLED
        if sink is DISCARD:
            if length <= _MAX_LINE or length > _DISCARD_BUFFER:
                self._discard, self._discard_index = length, index
                return
            if self._trash is None or len(self._trash) < length:
                self._trash = bytearray(_DISCARD_BUFFER)
            sink, value = memoryview(self._trash)[:length], DISCARD
        if sink is None:
            self._bulk = (index, length)
            return
        if len(sink) != length:
            raise ValueError(f"sink of {len(sink)} bytes for a bulk string of {length}")
        have = min(length, self._hi - self._lo)
        sink[:have] = memoryview(self._buf)[self._lo:self._lo + have]
        self._lo += have
        if have == length:
            self._crlf = 2
            self._emit_bulk(index, value)
        else:
            self._sink, self._sink_pos, self._sink_index, self._sink_value = sink, have, index, value

    def _emit_bulk(self, index: int, value: Any) -> None:
        call = self._call
        assert call is not None
        if call.on_bulk is not None:
            call.on_bulk(index, value)
        self._emit(value)

    def _emit(self, value: Any) -> None:
        call = self._call
        assert call is not None
        while call.stack:
            n, items = call.stack[-1]
            items.append(value)
            if len(items) < n:
                return
            call.stack.pop()
            value = items
        call.replies.append(value)

    def _maybe_done(self) -> None:
        call = self._call
        if (call is not None and not self._crlf and self._bulk is None and self._discard < 0 and self._sink is None
                and len(call.replies) == call.expected):
            self._call = None
            if not call.future.done():
                call.future.set_result(call.replies)


def _error(message: str) -> exceptions.RedisError:
    """The exception redis-py would raise for this error reply (OOM, READONLY, NOAUTH, LOADING ...)."""
    try:
        from redis._parsers.base import BaseParser

        err = BaseParser.parse_error(message)
        if isinstance(err, exceptions.RedisError):
            return err
    except Exception:  # noqa: BLE001 - a private helper of redis-py: fall back to the generic class
        pass
    return exceptions.ResponseError(message)


def _encode(commands: Sequence[Sequence[Any]]) -> list[bytes | memoryview]:
    """RESP arrays of bulk strings; long arguments stay views of the caller's memory (not copied here)."""
    out: list[bytes | memoryview] = []
    head = bytearray()
    for cmd in commands:
        head += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int):
                arg = b"%d" % arg
            n = len(arg) if not isinstance(arg, memoryview) else arg.nbytes
            head += b"$%d\r\n" % n
            if n <= _INLINE:
                head += arg
            else:
                out.append(bytes(head))
                head.clear()
                out.append(arg)
            head += b"\r\n"
    if head:
        out.append(bytes(head))
    return out


class RespConnection:
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    @classmethod
    async def open(cls, params: dict[str, Any], timeout: float) -> RespConnection:
        loop = asyncio.get_running_loop()
        try:
            if params.get("path"):
                opening = loop.create_unix_connection(_Protocol, params["path"])
            else:
                opening = loop.create_connection(_Protocol, params.get("host", "localhost"), params.get("port", 6379))
            transport, protocol = await asyncio.wait_for(opening, timeout)
        except OSError as e:  # TimeoutError included
            raise exceptions.ConnectionError(f"cannot connect to redis: {e!r}") from e
        conn = cls(transport, protocol)  # type: ignore[arg-type]
        try:
            hello: list[list[Any]] = []
            if params.get("password") is not None:
                user = params.get("username")
                hello.append(["AUTH", user, params["password"]] if user else ["AUTH", params["password"]])
            if params.get("db"):
                hello.append(["SELECT", int(params["db"])])
            if hello:
                for reply in await conn.call(hello, timeout=timeout):
                    if isinstance(reply, Exception):
                        raise exceptions.AuthenticationError(f"redis refused the connection setup: {reply}")
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def usable(self) -> bool:
        return self._protocol.lost is None and not self._transport.is_closing()

    def close(self) -> None:
        self._protocol.abort(ConnectionError("connection closed"))

    async def call(self, commands: Sequence[Sequence[Any]], *, timeout: float, sink_for: SinkFor | None = None,
                   on_bulk: OnBulk | None = None) -> list[Any]:
        """Send every command at once, return one reply per command (an error reply as an exception value)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._protocol.start(_Call(len(commands), sink_for, on_bulk, future))
        timer = loop.call_later(timeout, self._protocol.abort, TimeoutError(f"redis did not answer in {timeout:g}s"))
        try:
            for piece in _encode(commands):
                self._transport.write(piece)
            return await future
        except BaseException:
            if not future.done() or future.cancelled() or future.exception() is not None:
                self.close()
            raise
        finally:
            timer.cancel()


class RespPool:
    """Connections to one Redis, reused LIFO; at most ``max_connections`` open (callers beyond wait)."""

    def __init__(self, params: dict[str, Any], timeout: float, max_connections: int = 8) -> None:
        self.params = params
        self.timeout = timeout
        self._max = max_connections
        self._idle: list[RespConnection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self) -> RespConnection:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that opened them
            self._idle.clear()
            self._slots = asyncio.Semaphore(self._max)
            self._loop = loop
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if conn.usable:
                    return conn
            return await RespConnection.open(self.params, self.timeout)
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: RespConnection) -> None:
        if conn.usable:
            self._idle.append(conn)
        self._slots.release()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


_PLAIN_OPTIONS = {"host", "port", "db", "username", "password", "path", "socket_timeout", "socket_connect_timeout",
                  "connection_class"}


def plain_params(url: str) -> dict[str, Any] | None:
    """Connection parameters of a ``redis://`` or ``unix://`` URL this client can serve, else None (TLS, RESP3 or
    other options: the caller uses redis-py for those)."""
    from redis.asyncio.connection import Connection, UnixDomainSocketConnection, parse_url

    try:
        params = parse_url(url)
    except ValueError:
        return None
    if set(params) - _PLAIN_OPTIONS or params.get("connection_class", Connection) not in (
            Connection, UnixDomainSocketConnection):
        return None
    params.pop("connection_class", None)
    return params

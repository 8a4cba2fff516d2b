"""The gateway's HTTP protocol on a real uvicorn, spoken to over a raw socket: what the parser refuses comes back as
an OpenAI error body (400 ``invalid_http``), an over-long header section as 431 ``headers_too_large``, and neither
limit touches a valid request (a big body, big-but-allowed headers, two requests on one connection)."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import uvicorn
from uvicorn.server import ServerState

from embedmesh.gateway.protocol import MAX_HEADER_BYTES, GatewayHttpProtocol
from tests.unit.gateway.conftest import Harness


def _exchange(gw: Harness, raw: bytes | list[bytes], responses: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``raw`` (one write, or each of a list in turn) on one connection; read ``responses`` answers (status,
    headers, body)."""
    url = urlparse(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        for part in [raw] if isinstance(raw, bytes) else raw:
            s.sendall(part)
        buf = b""
        out: list[tuple[int, dict[str, str], bytes]] = []
        while len(out) < responses:
            while b"\r\n\r\n" not in buf:
                more = s.recv(65536)
                assert more, f"the connection closed after {len(out)} answers: {buf!r}"
                buf += more
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
            n = int(headers["content-length"])
            while len(buf) < n:
                more = s.recv(65536)
                assert more
                buf += more
            out.append((int(lines[0].split()[1]), headers, buf[:n]))
            buf = buf[n:]
        return out


def _models(extra: str = "") -> bytes:
    return f"GET /v1/models HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode()


def test_a_control_character_in_a_header_is_a_json_400_and_the_connection_closes(gw: Harness) -> None:
    [(status, headers, body)] = _exchange(gw, _models("x-note: a\x08b\r\n"))
    assert status == 400
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http" and err["type"] == "invalid_request_error"
    assert "not valid HTTP/1.1" in err["message"]


def test_a_malformed_request_line_is_a_json_400(gw: Harness) -> None:
    [(status, _, body)] = _exchange(gw, b"GET /v1/models HTTP/9.9.9 nonsense\r\n\r\n")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http"


def test_headers_over_the_limit_are_a_431_not_buffered(gw: Harness) -> None:
    big = "x-pad: " + "a" * (MAX_HEADER_BYTES + 10) + "\r\n"
    [(status, headers, body)] = _exchange(gw, _models(big))
    assert status == 431 and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["code"] == "headers_too_large" and str(MAX_HEADER_BYTES) in err["message"]


def test_headers_sent_in_many_small_writes_are_counted_together(gw: Harness) -> None:
    """One header line at a time, past the limit: refused once the lines add up to it; the client, still sending,
    reads the whole 431 and then the end of the connection (a gentle close: what it still sends is read and
    dropped, no reset that could destroy the answer)."""
    url = urlparse(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
        for _ in range(MAX_HEADER_BYTES // 1000 + 20):
            s.sendall(b"x-pad: " + b"a" * 991 + b"\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, body = got.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(body)["error"]["code"] == "headers_too_large"


def test_a_body_with_broken_chunked_framing_is_a_400_and_the_route_stops_reading(gw: Harness) -> None:
    """Framing that breaks in the middle of a body (the route is already reading it): the parser's 400, once."""
    raw = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nZZ\r\n")
    url = urlparse(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(raw)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    statuses = [line for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert statuses == [b"HTTP/1.1 400 Bad Request"], got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http"


def test_allowed_headers_a_big_body_and_keep_alive_are_untouched(gw: Harness) -> None:
    near = "x-pad: " + "a" * (MAX_HEADER_BYTES // 2) + "\r\n"
    body = b'{"model": "m", "prompt": "' + b"a" * (4 * MAX_HEADER_BYTES) + b'", "max_tokens": -1}'
    post = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body
    answers = _exchange(gw, _models(near) + _models(near) + post, responses=3)
    assert [a[0] for a in answers[:2]] == [200, 200]
    assert json.loads(answers[0][2])["object"] == "list"
    # The body went past the header limit's size without being taken for headers: the route read all of it
    # and refused the one field it found wrong.
    status, _, answer = answers[2]
    assert status == 400 and json.loads(answer)["error"]["param"] == "max_tokens"


class _Transport(asyncio.Transport):
    """What the protocol wrote, and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def test_a_pipelined_request_after_a_big_body_is_not_taken_for_long_headers() -> None:
    """The end of a request whose body is bigger than the header limit and the start of the next one, pipelined,
    arrive in one read: the next request's headers are counted from where it began, not with the first request's
    body (fed straight to the protocol, so the reads are exactly these)."""

    async def run() -> bytes:
        config = uvicorn.Config(_ok, log_config=None, lifespan="off", http=GatewayHttpProtocol)
        config.load()
        proto = GatewayHttpProtocol(config=config, server_state=ServerState(), app_state={})
        transport = _Transport()
        proto.connection_made(transport)
        body = b"a" * (3 * MAX_HEADER_BYTES)
        proto.data_received(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
        proto.data_received(body + b"GET /y HTTP/1.1\r\n")
        for _ in range(50):
            await asyncio.sleep(0.01)
        proto.data_received(b"host: x\r\n\r\n")
        for _ in range(50):
            await asyncio.sleep(0.01)
        proto.connection_lost(None)
        return transport.written

    written = asyncio.run(run())
    assert written.count(b"HTTP/1.1 200 OK") == 2, written[:400]
    assert b"headers_too_large" not in written


class _Settings:
    """An app whose gateway settings count how often they are read."""

    def __init__(self) -> None:
        self.reads = 0
        self.state = SimpleNamespace(gateway=self)

    @property
    def config(self) -> SimpleNamespace:
        self.reads += 1
        return SimpleNamespace(anon_connections_per_ip=3, anon_requests_per_ip=5, max_inflight=8, tenant_share=0.5,
                               metrics_require_key=True)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await _ok(scope, receive, send)


def test_a_servers_limits_are_built_once_from_its_settings_and_shared_by_its_connections() -> None:
    """The caps and the tenants' admission of a server come from the gateway's settings, read at its first
    connection only; its later connections share them, and another server has its own."""
    app = _Settings()

    async def run() -> list[GatewayHttpProtocol]:
        config = uvicorn.Config(app, log_config=None, lifespan="off", http=GatewayHttpProtocol)
        config.load()
        one, other = ServerState(), ServerState()
        protos = [GatewayHttpProtocol(config=config, server_state=s, app_state={}) for s in (one, one, one, other)]
        for proto in protos:
            proto.connection_made(_Transport())
        for proto in protos:
            proto.connection_lost(None)
        return protos

    a, b, c, d = asyncio.run(run())
    assert app.reads == 2  # one read per server, none per connection
    assert a._limits is b._limits is c._limits and d._limits is not a._limits
    limits = a._limits
    assert limits is not None and a._caps is limits.caps
    assert (limits.caps.connections_per_ip, limits.caps.requests_per_ip) == (3, 5)
    assert limits.admission.share == 4 and limits.metrics_require_key
    assert limits.admits("/v1/models") and not limits.admits("/metrics") and not limits.admits("/health")


def _read_answer_then_close(s: socket.socket) -> tuple[int, dict[str, Any]]:
    """Read one answer and then the end of the connection (a bounded number of reads, each with the socket's
    timeout)."""
    buf = b""
    for _ in range(1000):
        more = s.recv(65536)
        if not more:
            break
        buf += more
    else:
        raise AssertionError("the connection stayed open")
    head, _, body = buf.partition(b"\r\n\r\n")
    assert head, "closed without an answer"
    return int(head.split()[1]), json.loads(body)["error"]


def _trickle(s: socket.socket, parts: list[bytes], pause: float) -> None:
    import time

    for part in parts:
        try:
            s.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            return  # refused and closed while still sending: the answer is read next
        time.sleep(pause)


def test_headers_that_trickle_in_are_a_408_and_the_connection_closes(gw: Harness, monkeypatch: Any) -> None:
    """Slowloris: one header line at a time, slower than the header deadline allows."""
    from embedmesh.gateway import protocol

    monkeypatch.setattr(protocol, "HEADER_SECONDS", 0.6)
    url = urlparse(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        _trickle(s, [b"GET /v1/models HTTP/1.1\r\n"] + [b"x-slow: 1\r\n"] * 8, 0.25)
        status, err = _read_answer_then_close(s)
    assert status == 408 and err["code"] == "request_timeout" and "headers" in err["message"]
    with socket.create_connection((url.hostname, url.port), timeout=10) as idle:  # a connection that says nothing
        status, err = _read_answer_then_close(idle)
    assert status == 408


def test_a_body_that_trickles_in_is_a_408_and_one_at_the_allowed_pace_is_served(gw: Harness,
                                                                                monkeypatch: Any) -> None:
    from embedmesh.gateway import protocol

    monkeypatch.setattr(protocol, "BODY_SECONDS", 0.5)
    monkeypatch.setattr(protocol, "BODY_MIN_BYTES_PER_SECOND", 4096)
    url = urlparse(gw.url)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head % 64)
        _trickle(s, [b"{"] + [b" "] * 12, 0.25)  # a byte every 0.25 s: past 0.5 s + 13/4096 s
        status, err = _read_answer_then_close(s)
    assert status == 408 and err["code"] == "request_timeout" and "body" in err["message"]
    # 8 KiB in 4 pieces over ~0.9 s: allowed 0.5 s + 2 s; the route gets the body and answers it (no model: 400)
    body = b'{"prompt": "' + b"a" * (8192 - 14) + b'"}'
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head % len(body))
        _trickle(s, [body[i:i + 2048] for i in range(0, len(body), 2048)], 0.3)
        s.shutdown(socket.SHUT_WR)
        status, err = _read_answer_then_close(s)
    assert status == 400 and err["param"] == "model", err

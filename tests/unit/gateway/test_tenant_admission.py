"""A keyed tenant at its share is refused by the gateway's HTTP protocol from its headers (``protocol.py``,
``tenant_admission.py``): the real gateway app on a real uvicorn with the gateway's protocol, spoken to over raw
sockets. The refusal is the app's own 429 (same body, same Retry-After), no app task is started for it, a big body
is never waited for (the answer arrives before a byte of it is sent, and the connection closes), a small one is
skipped and its connection serves the next request; another tenant is admitted meanwhile. Both with the
performance bypasses on and off (``EMBEDMESH_FASTPATH``): this is a security rule, not a bypass."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core import auth
from embedmesh.gateway import GatewayConfig, create_app
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.protocol import SKIP_BODY_BYTES, GatewayHttpProtocol
from embedmesh.gateway.tenant_admission import TenantAdmission
from tests.support.raw_http import read_answer

SLOW, POLITE, RATED = "slowpoke-key-1", "polite-key-123", "rated-key-1234"


class _Counting(GatewayHttpProtocol):
    """The gateway's protocol, counting the app tasks it starts (one per request the app sees)."""

    started = 0

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        type(self).started += 1
        super()._start_asgi_task(cycle, app)


class _Mesh:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0
        self.app: Any = None
        self.port = 0


@pytest.fixture(params=["on", "off"])
async def served(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[_Mesh]:
    monkeypatch.setenv("EMBEDMESH_FASTPATH", request.param)
    key = auth.ApiKey
    auth.configure_keys(auth.KeyRing([
        key(auth._digest(SLOW), "slowpoke", max_concurrent_requests=1), key(auth._digest(POLITE), "polite"),
        key(auth._digest(RATED), "rated", requests_per_second=0.5)]))
    mesh = _Mesh()

    async def slow(request: Request) -> Response:
        mesh.held += 1
        await request.body()
        if request.query_params.get("hold"):
            await mesh.release.wait()  # as a body still trickling in, or a long generation, would: a slot is held
        return Response(b"{}", media_type="application/json")

    def extra(gw: Any) -> list[Route]:
        return [Route("/v1/test_slow", slow, methods=["POST"])]

    mesh.app = create_app(GatewayConfig(preprocessor="127.0.0.1:1", max_inflight=8, tenant_share=0.5),
                          extra_routes=[extra])
    _Counting.started = 0
    server = uvicorn.Server(uvicorn.Config(mesh.app, host="127.0.0.1", port=0, log_config=None, lifespan="off",
                                           http=_Counting, access_log=False))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    mesh.port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield mesh
    finally:
        mesh.release.set()
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        auth.configure_keys(auth.KeyRing())


def _post(key: str, headers: str = "", body: bytes = b"{}", path: str = "/v1/test_slow") -> bytes:
    length = "" if "content-length" in headers or "transfer-encoding" in headers else \
        f"content-length: {len(body)}\r\n"
    return (f"POST {path} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\n{length}{headers}\r\n").encode() + body


async def _hold(mesh: _Mesh) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """slowpoke's one request in flight (its key allows one), held until ``mesh.release``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    writer.write(_post(SLOW, path="/v1/test_slow?hold=1"))
    while mesh.held < 1:
        await asyncio.sleep(0.01)
    return reader, writer


async def _in_app_refusal(mesh: _Mesh, key: str) -> httpx.Response:
    """The app's own answer to the same request (through ASGI: this protocol is not in the way)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mesh.app), base_url="http://gw") as c:
        return await c.post("/v1/test_slow", headers={"Authorization": f"Bearer {key}"}, content=b"{}")


async def test_a_tenant_at_its_share_is_refused_before_its_100_mb_body_is_sent(served: _Mesh) -> None:
    mesh = served
    held_reader, held_writer = await _hold(mesh)
    started = _Counting.started
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    writer.write(_post(SLOW, "content-length: 100000000\r\ncontent-type: application/json\r\n", body=b""))
    status, headers, body = await read_answer(reader)  # no byte of the 100 MB was sent
    assert status == 429, body
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and "'slowpoke'" in err["message"] and "in flight" in err["message"]
    assert headers["retry-after"] == "1" and headers["connection"] == "close"
    assert _Counting.started == started  # no app task: nothing parsed, no route run
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed: the body is not waited for
    # The same answer the app gives (its own admission, behind this one, counts the held request too).
    in_app = await _in_app_refusal(mesh, SLOW)
    assert in_app.status_code == 429 and in_app.json() == json.loads(body)
    assert in_app.headers["retry-after"] == headers["retry-after"]
    # Another tenant is admitted meanwhile.
    r2, w2 = await asyncio.open_connection("127.0.0.1", mesh.port)
    w2.write(_post(POLITE))
    assert (await read_answer(r2))[0] == 200
    mesh.release.set()
    assert (await read_answer(held_reader))[0] == 200
    w2.write(_post(SLOW))  # the tenant's slot came back (on polite's kept-alive connection: keys are per request)
    assert (await read_answer(r2))[0] == 200
    for w in (writer, held_writer, w2):
        w.close()


async def test_a_small_refused_body_is_skipped_and_the_connection_serves_the_next_request(served: _Mesh) -> None:
    mesh = served
    held_reader, held_writer = await _hold(mesh)
    started = _Counting.started
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    body = b'{"prompt": "' + b"x" * (SKIP_BODY_BYTES - 100) + b'"}'
    writer.write(_post(SLOW, body=body))
    status, headers, answer = await read_answer(reader)
    assert status == 429 and json.loads(answer)["error"]["code"] == "rate_limit_exceeded"
    assert "connection" not in headers and headers["retry-after"] == "1"  # kept alive
    assert _Counting.started == started
    mesh.release.set()
    assert (await read_answer(held_reader))[0] == 200
    writer.write(_post(SLOW))  # the next request on the same connection: the skipped body was not taken for it
    assert (await read_answer(reader))[0] == 200
    assert _Counting.started == started + 1
    for w in (writer, held_writer):
        w.close()


async def test_a_request_without_a_body_is_refused_on_a_connection_that_stays(served: _Mesh) -> None:
    """A GET (no Content-Length, no body) of a tenant at its share: 429 from its headers, connection kept."""
    mesh = served
    held_reader, held_writer = await _hold(mesh)
    started = _Counting.started
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    writer.write(f"GET /v1/models HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {SLOW}\r\n\r\n".encode())
    status, headers, _ = await read_answer(reader)
    assert status == 429 and "connection" not in headers
    assert _Counting.started == started
    writer.write(_post(POLITE))  # the same connection serves the next request
    assert (await read_answer(reader))[0] == 200
    for w in (writer, held_writer):
        w.close()


@pytest.mark.parametrize("headers", ["content-length: 2\r\nexpect: 100-continue\r\n",
                                     "transfer-encoding: chunked\r\n"])
async def test_a_body_held_back_or_of_unknown_length_closes_the_connection(served: _Mesh, headers: str) -> None:
    """A client waiting for ``100 Continue`` never sends its body, and a chunked one may be any length: both get
    the 429 with ``Connection: close`` (no ``100 Continue`` before it) and the connection closes."""
    mesh = served
    held_reader, held_writer = await _hold(mesh)
    started = _Counting.started
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    writer.write(_post(SLOW, headers, body=b""))
    status, answer_headers, _ = await read_answer(reader)
    assert status == 429 and answer_headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert _Counting.started == started
    for w in (writer, held_writer):
        w.close()


async def test_a_tenant_over_its_requests_per_second_is_refused_from_its_headers(served: _Mesh) -> None:
    """0.5 requests per second (burst 1): the first is served, the next refused at once naming the rate, with the
    wait in Retry-After (2 s); the preprocessor would give the same answer after reading the body."""
    mesh = served
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    writer.write(_post(RATED))
    assert (await read_answer(reader))[0] == 200
    started = _Counting.started
    writer.write(_post(RATED))
    status, headers, body = await read_answer(reader)
    assert status == 429 and headers["retry-after"] == "2", (headers, body)
    err = json.loads(body)["error"]
    assert err == {"message": "tenant 'rated' is over its 0.5 requests per second", "type": "rate_limit_error",
                   "param": None, "code": "rate_limit_exceeded"}
    assert _Counting.started == started
    writer.write(_post(POLITE))  # kept alive; other tenants are not rated by it
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_routes_the_app_does_not_admit_are_never_refused_by_it(served: _Mesh) -> None:
    """/health and unknown routes are answered by the app as before, even for a tenant at its share."""
    mesh = served
    held_reader, held_writer = await _hold(mesh)
    reader, writer = await asyncio.open_connection("127.0.0.1", mesh.port)
    writer.write(f"GET /health HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {SLOW}\r\n\r\n".encode())
    assert (await read_answer(reader))[0] != 429
    writer.write(_post(SLOW, path="/v1/no_such_route"))
    assert (await read_answer(reader))[0] == 404
    for w in (writer, held_writer):
        w.close()


def test_the_share_the_key_limit_and_the_bucket() -> None:
    now = [0.0]
    adm = TenantAdmission(8, 0.5, clock=lambda: now[0])
    free = auth.ApiKey(b"a", "free")
    two = auth.ApiKey(b"b", "two", max_concurrent_requests=2)
    rated = auth.ApiKey(b"c", "rated", requests_per_second=2.0)
    assert [adm.enter(free) for _ in range(4)] == [None] * 4  # 0.5 of 8
    assert isinstance(adm.enter(free), ApiError)
    assert [adm.enter(two) for _ in range(2)] == [None, None] and adm.enter(two) is not None  # its key's 2 < 4
    adm.leave("two")
    assert adm.enter(two) is None  # a slot came back
    for _ in range(4):
        adm.leave("free")
    assert "free" not in adm.inflight  # forgotten once idle
    assert adm.enter(rated) is None and adm.enter(rated) is None  # burst: max(1, 2)
    adm.leave("rated")
    adm.leave("rated")
    err = adm.enter(rated)
    assert err is not None and err.retry_after == pytest.approx(0.5)
    now[0] += 0.5
    assert adm.enter(rated) is None  # refilled at 2 per second
    assert TenantAdmission(0, 0.5).cap(free) == 0  # no --max-inflight: only the key's own limit

"""Caps for clients without a valid key (``client_caps.py``), on a real uvicorn with the gateway's protocol, spoken to
over raw sockets from two loopback addresses: per IP, connections (the oldest idle one closed to make room, a new
one past the cap served only with a key) and requests in flight; per connection, pipelined requests. Each refusal is
a 429 with Retry-After; keyed requests and other addresses are not touched; with no keys configured nothing is
capped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn

from embedmesh.core import auth
from embedmesh.gateway import client_caps
from embedmesh.gateway.protocol import GatewayHttpProtocol
from tests.support.raw_http import read_answer

KEY = "good-key-123"


class _HeldApp:
    """Answers 200 once ``release`` is set (``/held``) or at once (any other path); counts requests it saw."""

    def __init__(self, connections: int, requests: int) -> None:
        self.state = SimpleNamespace(gateway=SimpleNamespace(config=SimpleNamespace(
            anon_connections_per_ip=connections, anon_requests_per_ip=requests)))
        self.release = asyncio.Event()
        self.seen = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen += 1
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/held":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
def keys() -> Iterator[None]:
    auth.configure_keys(auth.keyring_from_values(api_keys=f"{KEY}=alpha"))
    yield
    auth.configure_keys(auth.KeyRing())


async def _serve(app: _HeldApp) -> tuple[uvicorn.Server, int]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off",
                                           http=GatewayHttpProtocol, access_log=False))
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, server.servers[0].sockets[0].getsockname()[1]


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[_HeldApp, int]]:
    connections, requests = getattr(request, "param", (2, 2))
    app = _HeldApp(connections, requests)
    server, port = await _serve(app)
    yield app, port
    app.release.set()
    server.should_exit = True
    await asyncio.sleep(0.1)


async def _open(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    await asyncio.sleep(0.05)  # the server has seen the connection
    return reader, writer


def _get(path: str, key: str = "") -> bytes:
    auth_line = f"authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n{auth_line}\r\n".encode()


def _is_429(answer: tuple[int, dict[str, str], bytes], what: str) -> None:
    status, headers, body = answer
    assert status == 429, answer
    assert headers["retry-after"] == "1" and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and what in err["message"], err


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 10) == b""


@pytest.mark.parametrize("served", [(2, 8)], indirect=True)
async def test_a_new_connection_past_the_cap_closes_the_oldest_idle_one(keys: None, served: Any) -> None:
    app, port = served
    r1, w1 = await _open(port)  # says nothing: a slow client
    r2, w2 = await _open(port)
    r3, w3 = await _open(port)  # the third stranger's connection from this address
    _is_429(await read_answer(r1), "connections")
    assert await _closed(r1)
    for w in (w2, w3):  # the two newest are served
        w.write(_get("/now"))
    assert (await read_answer(r2))[0] == 200 and (await read_answer(r3))[0] == 200
    # another address has its own count
    others = [await _open(port, "127.0.0.2") for _ in range(2)]
    for r, w in others:
        w.write(_get("/now"))
        assert (await read_answer(r))[0] == 200
    for w in (w1, w2, w3, *(w for _, w in others)):
        w.close()


@pytest.mark.parametrize("served", [(2, 8)], indirect=True)
async def test_past_the_cap_with_every_connection_busy_only_a_keyed_request_is_served(keys: None,
                                                                                    served: Any) -> None:
    app, port = served
    busy = [await _open(port) for _ in range(2)]
    for _, w in busy:
        w.write(_get("/held"))
    await asyncio.sleep(0.1)
    r3, w3 = await _open(port)
    w3.write(_get("/now"))  # no key: this connection is past the cap and no other one is idle
    _is_429(await read_answer(r3), "connections")
    r4, w4 = await _open(port)
    w4.write(_get("/now", KEY) + _get("/now"))  # a key: served; the connection no longer counts
    assert (await read_answer(r4))[0] == 200 and (await read_answer(r4))[0] == 200
    app.release.set()
    for r, _ in busy:
        assert (await read_answer(r))[0] == 200
    for w in (w3, w4, *(w for _, w in busy)):
        w.close()


@pytest.mark.parametrize("served", [(16, 2)], indirect=True)
async def test_requests_in_flight_past_the_cap_are_429_and_keyed_ones_are_not_counted(keys: None,
                                                                                    served: Any) -> None:
    app, port = served
    held = [await _open(port) for _ in range(2)]
    for _, w in held:
        w.write(_get("/held"))
    await asyncio.sleep(0.1)
    r, w = await _open(port)
    w.write(_get("/now"))
    _is_429(await read_answer(r), "requests in flight")
    assert await _closed(r)
    keyed = [await _open(port) for _ in range(3)]
    for _, kw in keyed:
        kw.write(_get("/held", KEY))
    other_r, other_w = await _open(port, "127.0.0.2")
    other_w.write(_get("/now"))
    assert (await read_answer(other_r))[0] == 200  # another address: its own count
    app.release.set()
    for rr, _ in [*held, *keyed]:
        assert (await read_answer(rr))[0] == 200
    # the slots came back: two at once again
    again = [await _open(port) for _ in range(2)]
    for _, aw in again:
        aw.write(_get("/now"))
    for ar, _ in again:
        assert (await read_answer(ar))[0] == 200
    for ww in (w, other_w, *(x for _, x in [*held, *keyed, *again])):
        ww.close()


@pytest.mark.parametrize("served", [(16, 64)], indirect=True)
async def test_pipelined_requests_past_the_depth_are_429(keys: None, served: Any) -> None:
    app, port = served
    r, w = await _open(port)
    w.write(_get("/held") + _get("/now") * (client_caps.PIPELINE_DEPTH + 1))
    _is_429(await read_answer(r), "pipelined")
    assert await _closed(r)
    w.close()
    r2, w2 = await _open(port)
    w2.write(_get("/now", KEY) * (client_caps.PIPELINE_DEPTH + 4))  # keyed: served in order, every one
    for _ in range(client_caps.PIPELINE_DEPTH + 4):
        assert (await read_answer(r2))[0] == 200
    w2.close()


@pytest.mark.parametrize("served", [(1, 1)], indirect=True)
async def test_with_no_keys_configured_nothing_is_capped(served: Any) -> None:
    app, port = served
    conns = [await _open(port) for _ in range(4)]
    for _, w in conns:
        w.write(_get("/held"))
    await asyncio.sleep(0.1)
    app.release.set()
    for r, _ in conns:
        assert (await read_answer(r))[0] == 200
    for _, w in conns:
        w.close()


async def test_the_gateways_settings_set_the_caps(keys: None) -> None:
    """``--anon-connections-per-ip`` reaches the protocol of the gateway's own app; negative caps are refused."""
    from embedmesh.gateway import GatewayConfig, create_app

    with pytest.raises(ValueError, match="anon_connections_per_ip"):
        GatewayConfig(preprocessor="127.0.0.1:1", anon_connections_per_ip=-1)
    app = create_app(GatewayConfig(preprocessor="127.0.0.1:1", anon_connections_per_ip=1, anon_requests_per_ip=1))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off",
                                           http=GatewayHttpProtocol, access_log=False))
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        r1, w1 = await _open(port)
        r2, w2 = await _open(port)  # one stranger's connection at a time: the first makes room
        _is_429(await read_answer(r1), "connections")
        w1.close()
        w2.close()
    finally:
        server.should_exit = True
        await asyncio.sleep(0.1)


def test_a_connection_handed_to_a_websocket_protocol_gives_back_what_it_held(keys: None) -> None:
    """An upgraded connection's HTTP protocol never hears of it again: its count and request go back at once."""
    from uvicorn.server import ServerState

    class _T(asyncio.Transport):
        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.9", 40000)}.get(name, default)

        def is_closing(self) -> bool:
            return False

    async def run() -> tuple[dict[str, Any], dict[str, int], dict[str, Any], dict[str, int]]:
        app = _HeldApp(8, 8)
        config = uvicorn.Config(app, log_config=None, lifespan="off", http=GatewayHttpProtocol)
        config.load()
        proto = GatewayHttpProtocol(config=config, server_state=ServerState(), app_state={})
        proto.connection_made(_T())
        caps = proto._caps
        assert caps is not None
        proto.headers = []
        anonymous, _ = proto._admit_request()  # a request without a key, counted
        proto._counted.append((anonymous, None))
        held = (dict(caps.anonymous), dict(caps.requests))
        proto.scope = {"method": "GET", "headers": []}  # type: ignore[typeddict-item]
        try:
            proto.handle_websocket_upgrade()
        except Exception:  # noqa: BLE001 - no websocket protocol installed here: only what is given back matters
            pass
        return held[0], held[1], dict(caps.anonymous), dict(caps.requests)

    anon_before, requests_before, anon_after, requests_after = asyncio.run(run())
    assert list(anon_before) == ["127.0.0.9"] and requests_before == {"127.0.0.9": 1}
    assert anon_after == {} and requests_after == {}


def test_an_ipv6_client_is_counted_by_its_64_and_a_mapped_ipv4_as_ipv4() -> None:
    key = client_caps.address_key
    assert key("2001:db8:1:2::1") == key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert key("2001:db8:1:3::1") != key("2001:db8:1:2::1")
    assert key("::ffff:192.0.2.7") == key("192.0.2.7") == "192.0.2.7"
    assert key("192.0.2.7") != key("192.0.2.8")

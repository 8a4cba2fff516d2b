"""API keys at the REST edge: every /v1 route answers 401 ``invalid_api_key`` in OpenAI's shape without a valid key
(before reading the body), /health stays open, /metrics is open unless asked, and the gateway forwards the client's
key to the gRPC services instead of using any credential of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from embedmesh.core import auth
from embedmesh.gateway import GatewayConfig, create_app
from embedmesh.gateway.auth import OPEN_PATHS, _authorization
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.worker_generate import worker_generate


@pytest.fixture
def keys() -> Iterator[None]:
    auth.configure_keys(auth.keyring_from_values(api_keys="good-key-123=alpha"))
    yield
    auth.configure_keys(auth.KeyRing())


def _app(**kw: Any) -> Any:
    return create_app(GatewayConfig(preprocessor="127.0.0.1:1", vector_store="127.0.0.1:1", **kw))


def _v1_routes(app: Any) -> list[tuple[str, str]]:
    out = []
    for r in app.routes:
        if isinstance(r, Route) and r.path.startswith("/v1"):
            path = r.path.replace("{", "").replace("}", "")  # path parameters get a literal value
            for m in sorted(r.methods or ["GET"]):
                if m != "HEAD":
                    out.append((m, path))
    return out


async def test_every_v1_route_needs_a_valid_key(keys: None) -> None:
    app = _app()
    routes = _v1_routes(app)
    assert len(routes) >= 15, routes  # completions, chat, embeddings, models, uploads, files, vector stores...
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong-key-000"}, {"Authorization": "good-key-123"}):
                r = await c.request(method, path, headers=headers, content=b"{not json")
                assert r.status_code == 401, (method, path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert "good-key-123" not in r.text and "wrong-key-000" not in r.text
        # With the key, the same route goes past authentication (to body checks or the unreachable backend).
        r = await c.post("/v1/completions", headers={"Authorization": "Bearer good-key-123"}, content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert (await c.get("/metrics")).status_code == 200


async def test_every_route_outside_v1_needs_the_key_too_but_health(keys: None) -> None:
    """The admin routes outside /v1/ (/sleep, /wake_up, /is_sleeping) were left to the service behind them."""
    app = _app()
    outside = [(m, r.path) for r in app.routes if isinstance(r, Route) and not r.path.startswith("/v1")
               for m in sorted(r.methods or ["GET"]) if m != "HEAD" and r.path not in (*OPEN_PATHS, "/metrics")]
    assert {p for _, p in outside} >= {"/sleep", "/wake_up", "/is_sleeping"}, outside
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for method, path in outside:
            r = await c.request(method, path, content=b"{}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
            r = await c.request(method, path, content=b"{}", headers={"Authorization": "Bearer good-key-123"})
            assert r.status_code != 401, (method, path, r.text)  # past the key, to the (unreachable) backend
        assert (await c.get("/health")).status_code != 401


@pytest.mark.parametrize("with_keys", [True, False])
async def test_more_than_one_authorization_header_is_a_400_naming_it(with_keys: bool) -> None:
    if with_keys:
        auth.configure_keys(auth.keyring_from_values(api_keys="good-key-123=alpha"))
    try:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            for first, second in (("Bearer good-key-123", "Bearer wrong-key-000"),
                                  ("Bearer wrong-key-000", "Bearer good-key-123"),
                                  ("Bearer good-key-123", "Bearer good-key-123")):
                headers = [("Authorization", first), ("Authorization", second)]
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/sleep")):
                    r = await c.request(method, path, headers=headers, content=b"{not json")
                    assert r.status_code == 400, (method, path, r.text)
                    err = r.json()["error"]
                    assert err["param"] == "Authorization" and err["code"] == "duplicate_header"
                    assert "good-key-123" not in r.text
    finally:
        auth.configure_keys(auth.KeyRing())


async def test_metrics_can_require_the_key(keys: None) -> None:
    transport = httpx.ASGITransport(app=_app(metrics_require_key=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers={"Authorization": "Bearer good-key-123"})).status_code == 200


async def test_without_keys_routes_are_open() -> None:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400


class _Seen(worker_pb2_grpc.WorkerServiceServicer):
    """Answers every call kind with the ``authorization`` metadata it received."""

    @staticmethod
    def _auth(context: Any) -> str:
        return dict(context.invocation_metadata()).get("authorization", "")

    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 - unary-unary
        return worker_pb2.GetInfoResponse(model=self._auth(context))

    async def GenerateMany(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802 - stream-stream
        async for message in request_iterator:
            for frame in message.frames:
                yield worker_pb2.GenerateManyResponse(results=[
                    worker_pb2.GenerateResult(id=frame.id, response=worker_pb2.GenerateResponse(
                        text=self._auth(context))),
                    worker_pb2.GenerateResult(id=frame.id, end=worker_pb2.GenerationEnd())])


@pytest.mark.parametrize("fast", [True, False])  # metadata straight into each call, or interceptors (plain path)
async def test_forwarding_channel_carries_the_requests_key_on_every_call_kind(
        fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from embedmesh.core import fastpath
    from embedmesh.core.server import Server, ServerOptions
    from embedmesh.gateway.auth import forwarding_channel

    monkeypatch.setenv(fastpath.ENV, "on" if fast else "off")

    server = Server("t", ServerOptions(port=0, grace_seconds=0.1))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, _Seen(), "embedmesh.worker.v1.WorkerService")
    await server.start()
    ch = forwarding_channel(server.address)
    stub = worker_pb2_grpc.WorkerServiceStub(ch)
    try:
        token = _authorization.set("Bearer good-key-123")
        try:
            unary = await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=[("authorization", "Bearer spoofed")])
            streamed = [r.text async for r in worker_generate(stub, worker_pb2.GenerateRequest())]
        finally:
            _authorization.reset(token)
        assert unary.model == "Bearer good-key-123"  # the request's key replaces anything else
        assert streamed == ["Bearer good-key-123"]
        assert (await stub.GetInfo(worker_pb2.GetInfoRequest())).model == ""  # outside a request: nothing
    finally:
        await ch.close()
        await server.drain()

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
from embedmesh.gateway.auth import _authorization, _ForwardAuthorization


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


def test_forwarding_interceptor_carries_only_the_current_requests_key() -> None:
    from collections import namedtuple

    Details = namedtuple("Details", "method timeout metadata credentials wait_for_ready")
    fwd = _ForwardAuthorization()
    d = Details("/x", None, [("authorization", "Bearer spoofed"), ("other", "1")], None, None)
    token = _authorization.set("Bearer good-key-123")
    try:
        md = fwd._details(d).metadata
    finally:
        _authorization.reset(token)
    assert ("authorization", "Bearer good-key-123") in md and ("authorization", "Bearer spoofed") not in md
    assert ("other", "1") in md
    assert fwd._details(d).metadata == d.metadata  # no request key: nothing added

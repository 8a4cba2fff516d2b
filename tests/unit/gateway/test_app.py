"""/v1/models, /health, /metrics, unknown routes and methods."""

from __future__ import annotations

import httpx

from embedmesh.core.errors import Unavailable
from tests.unit.gateway.conftest import MODEL, Harness


def test_models(gw: Harness) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{gw.url}/v1/models", timeout=10).json()
    assert raw["object"] == "list"
    m = raw["data"][0]
    assert m["object"] == "model" and m["owned_by"] == "embedmesh" and m["created"] == 1700000000
    assert m["max_model_len"] == 2048 and m["hidden_size"] == 576


def test_models_error_is_mapped(gw: Harness) -> None:
    gw.fake.script.error = Unavailable("loading")
    r = httpx.get(f"{gw.url}/v1/models", timeout=10)
    assert r.status_code == 503 and r.json()["error"]["message"] == "loading"


def test_health_follows_the_preprocessors_health(gw: Harness) -> None:
    r = httpx.get(f"{gw.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [s["service"] for s in r.json()["services"]] == ["gateway", "preprocessor"]
    gw.set_serving(False)
    r = httpx.get(f"{gw.url}/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "unavailable" and r.json()["detail"]
    gw.set_serving(True)
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200


def test_health_when_the_preprocessor_is_unreachable(gw: Harness) -> None:
    r = httpx.get(f"{gw.dead_url}/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "unavailable" and "unreachable" in r.json()["detail"]


def test_metrics_count_requests_by_route_and_status(gw: Harness) -> None:
    httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 0}, timeout=10)
    r = httpx.get(f"{gw.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'embedmesh_gateway_requests_total{route="/v1/completions",status="200"}' in text
    assert 'embedmesh_gateway_requests_total{route="/v1/completions",status="400"}' in text
    assert 'embedmesh_gateway_request_duration_seconds_bucket{le="0.001",route="/v1/completions"}' in text
    assert "embedmesh_gateway_inflight_requests " in text
    assert "embedmesh_gateway_stream_disconnects_total " in text


def test_unknown_route_is_404_json(gw: Harness) -> None:
    r = httpx.get(f"{gw.url}/v1/nothing-here", timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and "/v1/nothing-here" in err["message"]


def test_wrong_method_is_405_json(gw: Harness) -> None:
    r = httpx.get(f"{gw.url}/v1/completions", timeout=10)
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error" and "GET" in r.json()["error"]["message"]
    assert "POST" in r.headers.get("allow", "")


def test_extra_routes_plug_in_with_the_gateway_and_share_errors_and_metrics() -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from embedmesh.gateway import GatewayConfig, create_app
    from embedmesh.gateway.errors import bad_request

    seen: list[object] = []

    def factory(gateway: object) -> list[Route]:
        seen.append(gateway)

        async def thing(request: Request) -> JSONResponse:
            raise bad_request("name", "is required", "missing")

        async def boom(request: Request) -> JSONResponse:
            raise RuntimeError("secret internals")

        return [Route("/v1/things", thing, methods=["POST"]), Route("/v1/boom", boom)]

    app = create_app(GatewayConfig(preprocessor="127.0.0.1:1"), extra_routes=[factory])
    assert seen == [app.state.gateway]
    with TestClient(app) as http:
        r = http.post("/v1/things", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = http.get("/v1/boom")
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "internal server error", "type": "server_error", "param": None,
                                     "code": "internal_error"}

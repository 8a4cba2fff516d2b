"""/openapi.json and /docs: a valid OpenAPI 3.1 document of every route the app serves, its request schemas the
request models', real answers valid against its response schemas, both routes open when keys are configured."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from embedmesh.core import auth
from embedmesh.gateway import GatewayConfig, create_app, openapi
from tests.unit.gateway.conftest import Harness


def _app() -> Any:
    return create_app(GatewayConfig(preprocessor="127.0.0.1:1", vector_store="127.0.0.1:1"))


def _validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator for one component of ``doc`` (its $refs resolved within the document)."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture
def keys() -> Iterator[None]:
    auth.configure_keys(auth.keyring_from_values(api_keys="good-key-123=alpha"))
    yield
    auth.configure_keys(auth.KeyRing())


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = openapi.document(_app().routes)
    assert doc["openapi"] == "3.1.0"
    validate(doc)


def test_every_served_route_is_described() -> None:
    """A route added to the app without an entry in OPERATIONS fails here (the document still lists it)."""
    app = _app()
    served = openapi.served_operations(app.routes)
    assert ("post", "/v1/completions") in served and ("get", "/openapi.json") in served
    assert ("get", "/docs") in served and ("get", "/v1/vector_stores/{id}/files/{file_id}") in served
    undescribed = [op for op in served if op not in openapi.OPERATIONS]
    assert not undescribed, f"served but not in openapi.OPERATIONS: {undescribed}"
    stale = [op for op in openapi.OPERATIONS if op not in served]
    assert not stale, f"described but not served: {stale}"
    doc = openapi.document(app.routes)
    assert sorted((m, p) for p, ops in doc["paths"].items() for m in ops) == sorted(served)


def test_a_new_route_appears_in_the_document_even_undescribed() -> None:
    async def hello(request: Any) -> Any:
        raise AssertionError

    app = create_app(GatewayConfig(preprocessor="127.0.0.1:1"), extra_routes=[Route("/v1/hello/{x}", hello)])
    doc = openapi.document(app.routes)
    op = doc["paths"]["/v1/hello/{x}"]["get"]
    assert op["tags"] == ["undescribed"] and op["parameters"][0]["name"] == "x"
    validate(doc)


def test_every_error_status_is_openais_error_body() -> None:
    doc = openapi.document(_app().routes)
    err = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"]["default"]["content"]["application/json"]["schema"] == err
            for status in ("401", "429", "500"):
                assert op["responses"][status]["content"]["application/json"]["schema"] == err, (method, path)
            if "requestBody" in op:
                assert {"400", "413"} <= set(op["responses"]), (method, path)
    v = _validator(doc, "ErrorResponse")
    v.validate({"error": {"message": "m", "type": "invalid_request_error", "param": "prompt", "code": None}})
    with pytest.raises(jsonschema.ValidationError):
        v.validate({"detail": "Not Found"})


def test_request_bodies_are_the_request_models_with_the_prompt_embeds_extensions() -> None:
    doc = openapi.document(_app().routes)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    schemas = doc["components"]["schemas"]
    temp = schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temp["minimum"] == 0 and temp["maximum"] == 100  # core/sampling.py's range, through the model
    assert "embeddings" in schemas["CompletionRequest"]["properties"]["prompt_embeds"]["description"]
    assert "id" in str(schemas["EmbedsPart"]["properties"]["data"])
    completion = _validator(doc, "CompletionRequest")
    completion.validate({"model": "m", "prompt_embeds": "AAAA", "max_tokens": 4})
    completion.validate({"model": "m", "prompt_embeds": [{"id": "emb-1"}, "AAAA"], "prompt": "x"})
    with pytest.raises(jsonschema.ValidationError):
        completion.validate({"model": "m", "prompt_embeds": [], "temperature": 1})
    with pytest.raises(jsonschema.ValidationError):
        completion.validate({"model": "m", "temperature": 101})
    chat = _validator(doc, "ChatRequest")
    chat.validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "prompt_embeds", "data": "AAAA"}]}]})
    upload = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert set(upload["multipart/form-data"]["schema"]["required"]) == {"file", "purpose"}


def test_real_answers_validate_against_the_response_schemas(gw: Harness) -> None:
    doc = httpx.get(f"{gw.url}/openapi.json", timeout=10).json()
    answers = {
        "Completion": httpx.post(f"{gw.url}/v1/completions", json={"model": "fake-model", "prompt": "hi"},
                                 timeout=10),
        "ChatCompletion": httpx.post(f"{gw.url}/v1/chat/completions", timeout=10, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}),
        "ModelList": httpx.get(f"{gw.url}/v1/models", timeout=10),
        "Health": httpx.get(f"{gw.url}/health", timeout=10),
        "ErrorResponse": httpx.post(f"{gw.url}/v1/completions", json={"model": "fake-model", "prompt": 3},
                                    timeout=10),
    }
    for name, r in answers.items():
        _validator(doc, name).validate(r.json())
    assert answers["ErrorResponse"].status_code == 400
    stream = httpx.post(f"{gw.url}/v1/completions", timeout=10,
                        json={"model": "fake-model", "prompt": "hi", "stream": True})
    media = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert stream.headers["content-type"].split(";")[0] in media


async def test_openapi_and_docs_are_open_with_keys_configured(keys: None) -> None:
    app = _app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/openapi.json")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == openapi.document(app.routes)
        page = await c.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/v1/chat/completions" in page.text and "/openapi.json" in page.text and "<script" not in page.text
        assert (await c.get("/v1/models")).status_code == 401  # the rest still needs the key

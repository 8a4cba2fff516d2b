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


def _check(doc: dict[str, Any], method: str, path: str, r: httpx.Response) -> None:
    """``r`` (an answer of ``method path``) has a status, media type and body the document gives that route."""
    responses = doc["paths"][path][method]["responses"]
    entry = responses.get(str(r.status_code), responses["default"])
    media = r.headers["content-type"].split(";")[0]
    content = entry["content"]
    assert media in content or "*/*" in content, (method, path, media, list(content))
    if media == "application/json":
        schema = content[media]["schema"]
        jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(r.json())


def test_files_vector_stores_and_embeddings_answers_validate() -> None:
    """Every files and vector-store route, and /v1/embeddings, through the scripted stubs of their own tests."""
    from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
    from tests.unit.gateway import test_embeddings, test_files, test_vector_stores
    from tests.unit.gateway.test_files import FILE
    from tests.unit.gateway.test_vector_stores import STORE, VS_FILE

    doc = openapi.document(_app().routes)
    fhttp, _ = test_files.client(
        UploadFile=pb.UploadFileResponse(file=FILE), ListFiles=pb.ListFilesResponse(data=[FILE], page=pb.PageInfo(
            first_id="file-1", last_id="file-1", has_more=True)),
        GetFile=pb.GetFileResponse(file=FILE), DeleteFile=pb.DeleteFileResponse(id="file-1", deleted=True),
        GetFileContent=[pb.GetFileContentResponse(chunk=b"# Hello\n")])
    f = "/v1/files/{file_id}"
    for method, path, r in [
        ("post", "/v1/files", fhttp.post("/v1/files", files={"file": ("a.md", b"# Hi")}, data={"purpose": "x"})),
        ("post", "/v1/files", fhttp.post("/v1/files", data={"purpose": "x"})),
        ("get", "/v1/files", fhttp.get("/v1/files?limit=1")),
        ("get", "/v1/files", fhttp.get("/v1/files?limit=x")),
        ("get", f, fhttp.get("/v1/files/file-1")),
        ("delete", f, fhttp.delete("/v1/files/file-1")),
        ("get", f + "/content", fhttp.get("/v1/files/file-1/content")),
    ]:
        _check(doc, method, path, r)

    batch = pb.VectorStoreFileBatch(id="vsfb_1", vector_store_id="vs_1", status=pb.FILE_STATUS_IN_PROGRESS)
    vhttp, _ = test_vector_stores.client(
        CreateVectorStore=pb.CreateVectorStoreResponse(vector_store=STORE),
        ListVectorStores=pb.ListVectorStoresResponse(data=[STORE], page=pb.PageInfo()),
        GetVectorStore=pb.GetVectorStoreResponse(vector_store=STORE),
        UpdateVectorStore=pb.UpdateVectorStoreResponse(vector_store=pb.VectorStore(
            id="vs_2", status=pb.VECTOR_STORE_STATUS_COMPLETED)),
        DeleteVectorStore=pb.DeleteVectorStoreResponse(id="vs_1", deleted=True),
        CreateVectorStoreFile=pb.CreateVectorStoreFileResponse(file=VS_FILE),
        ListVectorStoreFiles=pb.ListVectorStoreFilesResponse(data=[VS_FILE]),
        GetVectorStoreFile=pb.GetVectorStoreFileResponse(file=pb.VectorStoreFile(
            id="file-2", status=pb.FILE_STATUS_COMPLETED)),
        UpdateVectorStoreFile=pb.UpdateVectorStoreFileResponse(file=VS_FILE),
        DeleteVectorStoreFile=pb.DeleteVectorStoreFileResponse(id="file-1", deleted=True),
        CreateVectorStoreFileBatch=pb.CreateVectorStoreFileBatchResponse(batch=batch),
        GetVectorStoreFileBatch=pb.GetVectorStoreFileBatchResponse(batch=batch),
        CancelVectorStoreFileBatch=pb.CancelVectorStoreFileBatchResponse(batch=batch),
        ListVectorStoreFileBatchFiles=pb.ListVectorStoreFileBatchFilesResponse(data=[VS_FILE]),
        SearchVectorStore=pb.SearchVectorStoreResponse(search_queries=["q"], data=[pb.SearchResult(
            file_id="file-1", filename="a.md", score=0.5, attributes={"n": pb.AttributeValue(number_value=1.5)},
            content=[pb.SearchContent(type="text", text="Paris")])]))
    s, sf, b = "/v1/vector_stores/{id}", "/v1/vector_stores/{id}/files/{file_id}", \
        "/v1/vector_stores/{id}/file_batches/{batch_id}"
    for method, path, r in [
        ("post", "/v1/vector_stores", vhttp.post("/v1/vector_stores", json={"name": "docs"})),
        ("post", "/v1/vector_stores", vhttp.post("/v1/vector_stores", json={"name": 3})),
        ("get", "/v1/vector_stores", vhttp.get("/v1/vector_stores")),
        ("get", s, vhttp.get("/v1/vector_stores/vs_1")),
        ("post", s, vhttp.post("/v1/vector_stores/vs_2", json={"expires_after": None})),
        ("delete", s, vhttp.delete("/v1/vector_stores/vs_1")),
        ("post", s + "/files", vhttp.post("/v1/vector_stores/vs_1/files", json={"file_id": "file-1"})),
        ("get", s + "/files", vhttp.get("/v1/vector_stores/vs_1/files?filter=completed")),
        ("get", sf, vhttp.get("/v1/vector_stores/vs_1/files/file-2")),
        ("post", sf, vhttp.post("/v1/vector_stores/vs_1/files/file-1", json={"attributes": {"a": True}})),
        ("delete", sf, vhttp.delete("/v1/vector_stores/vs_1/files/file-1")),
        ("post", s + "/file_batches", vhttp.post("/v1/vector_stores/vs_1/file_batches", json={"file_ids": ["a"]})),
        ("get", b, vhttp.get("/v1/vector_stores/vs_1/file_batches/vsfb_1")),
        ("post", b + "/cancel", vhttp.post("/v1/vector_stores/vs_1/file_batches/vsfb_1/cancel")),
        ("get", b + "/files", vhttp.get("/v1/vector_stores/vs_1/file_batches/vsfb_1/files")),
        ("post", s + "/search", vhttp.post("/v1/vector_stores/vs_1/search", json={"query": "q"})),
    ]:
        _check(doc, method, path, r)

    ehttp, _ = test_embeddings.client()
    for fmt in ("float", "base64"):
        r = ehttp.post("/v1/embeddings", json={"model": "e", "input": "hi", "encoding_format": fmt})
        assert r.status_code == 200
        _check(doc, "post", "/v1/embeddings", r)


def test_the_body_examples_are_valid_bodies() -> None:
    doc = openapi.document(_app().routes)
    for ops in doc["paths"].values():
        for op in ops.values():
            media = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            if "example" in media:
                _validator(doc, media["schema"]["$ref"].rsplit("/", 1)[1]).validate(media["example"])

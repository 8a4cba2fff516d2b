"""gateway/uploads.py: ``/v1/prompt_embeds`` through a bare app with a scripted EncoderCacheService stub — the Put
stream an upload becomes (header, then the bytes in 1 MiB chunks), the JSON answers, every refusal of the body
(before any call) and the service's refusals as the gateway words them."""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest

from embedmesh.cache.v1 import cache_pb2
from embedmesh.core.errors import InvalidArgument
from embedmesh.gateway import embeds_json, uploads
from embedmesh.tensor.v1 import tensor_pb2
from tests.unit.gateway.conftest import FakeStub, bare_gateway, route_client, rpc_error

STORED = cache_pb2.PutResponse(key="emb-0123", stored=True, size_bytes=3_000_000, dtype=tensor_pb2.DATA_TYPE_FP32,
                               shape=[5, 576], expires_at=1_800_000_000)


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(**answers: Any) -> tuple[Any, FakeStub]:
        stub = FakeStub(**answers)
        gw = bare_gateway(request_timeout_seconds=42)
        monkeypatch.setattr(uploads.cache_pb2_grpc, "EncoderCacheServiceStub", lambda channel: stub)
        return route_client(uploads.routes(gw)), stub
    return make


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_an_upload_streams_a_header_then_its_bytes_in_1_mib_chunks(make: Any) -> None:
    http, stub = make(Put=STORED)
    data = os.urandom((2 << 20) + 5)
    r = http.post("/v1/prompt_embeds", json={"data": b64(data), "ttl_seconds": 60, "note": "ignored"})
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "emb-0123", "object": "prompt_embeds", "shape": [5, 576], "dtype": "float32",
                        "bytes": 3_000_000, "expires_at": 1_800_000_000}
    [(method, messages, timeout)] = stub.calls
    assert (method, timeout) == ("Put", 42)
    assert messages[0] == cache_pb2.PutRequest(header=cache_pb2.PutHeader(
        encoding=tensor_pb2.TENSOR_ENCODING_TORCH_SAVE, ttl_seconds=60))
    assert [len(m.chunk) for m in messages[1:]] == [1 << 20, 1 << 20, 5]
    assert b"".join(m.chunk for m in messages[1:]) == data


def test_a_big_upload_is_read_already_decoded_and_answers_as_the_usual_parse(make: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The body's long base64 ``data`` is decoded straight from the body (embeds_json), never made a str: the same
    bytes go out; a body whose base64 is broken falls back to the usual parse and gets its usual 400."""
    read: list[bool] = []
    loads = embeds_json.loads

    def spy(raw: bytes, slots: Any) -> Any:
        body = loads(raw, slots)
        read.append(body is not None and isinstance(body.get("data"), embeds_json.Base64Text))
        return body

    monkeypatch.setattr(embeds_json, "loads", spy)
    http, stub = make(Put=STORED)
    data = os.urandom(3 << 20)
    assert http.post("/v1/prompt_embeds", json={"ttl_seconds": 60, "data": b64(data)}).status_code == 200
    assert read == [True]
    assert b"".join(m.chunk for m in stub.last("Put")[1:]) == data
    broken = http.post("/v1/prompt_embeds", json={"data": b64(data)[:-1]})
    assert read == [True, False]
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "data"
    assert broken.json()["error"]["code"] == "invalid_base64"


def test_without_ttl_the_header_leaves_it_unset_and_a_huge_one_is_clamped(make: Any) -> None:
    http, stub = make(Put=STORED)
    assert http.post("/v1/prompt_embeds", json={"data": b64(b"x"), "ttl_seconds": None}).status_code == 200
    assert not stub.last("Put")[0].header.HasField("ttl_seconds")
    assert http.post("/v1/prompt_embeds", json={"data": b64(b"x"), "ttl_seconds": 2**40}).status_code == 200
    assert stub.last("Put")[0].header.ttl_seconds == 2**32 - 1


@pytest.mark.parametrize(("body", "param", "message", "code"), [
    ({}, "data", "data: must be a base64 string, got NoneType", "invalid_type"),
    ({"data": ["QUJD"]}, "data", "data: must be a base64 string, got list", "invalid_type"),
    ({"data": "QUJD="}, "data", "data: is not valid base64 (standard alphabet, with padding)", "invalid_base64"),
    ({"data": "QUJD", "ttl_seconds": 0}, "ttl_seconds", "ttl_seconds: must be an integer >= 1", "invalid_value"),
    ({"data": "QUJD", "ttl_seconds": -5}, "ttl_seconds", "ttl_seconds: must be an integer >= 1", "invalid_value"),
    ({"data": "QUJD", "ttl_seconds": 1.5}, "ttl_seconds", "ttl_seconds: must be an integer >= 1", "invalid_value"),
    ({"data": "QUJD", "ttl_seconds": False}, "ttl_seconds", "ttl_seconds: must be an integer >= 1",
     "invalid_value"),
    ({"ttl_seconds": 0, "data": 7}, "data", "data: must be a base64 string, got int", "invalid_type"),
])
def test_a_bad_body_is_a_400_naming_the_field_before_any_call(make: Any, body: dict[str, Any], param: str,
                                                              message: str, code: str) -> None:
    http, stub = make(Put=STORED)
    r = http.post("/v1/prompt_embeds", json=body)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    assert stub.calls == []


def test_a_body_that_is_not_an_object_is_the_usual_400(make: Any) -> None:
    http, _ = make(Put=STORED)
    r = http.post("/v1/prompt_embeds", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_tensor_the_cache_cannot_hold_is_a_413(make: Any) -> None:
    http, _ = make(Put=cache_pb2.PutResponse(stored=False, size_bytes=123))
    r = http.post("/v1/prompt_embeds", json={"data": b64(b"x")})
    assert r.status_code == 413 and r.json()["error"] == {
        "message": "data: the tensor (123 bytes) is larger than the cache", "type": "invalid_request_error",
        "param": "data", "code": "too_large"}


def test_a_refused_chunk_names_data(make: Any) -> None:
    http, _ = make(Put=rpc_error(InvalidArgument("chunk: the tensor has NaN at row 2", field="chunk",
                                                 reason="EMBEDS_NAN")))
    r = http.post("/v1/prompt_embeds", json={"data": b64(b"x")})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "data: the tensor has NaN at row 2", "type": "invalid_request_error", "param": "data",
        "code": "embeds_nan"}


def test_a_ttl_past_the_wire_range_is_refused_with_the_value_the_client_sent(make: Any) -> None:
    refusal = rpc_error(InvalidArgument("ttl_seconds: must be at most 2592000, got 4294967295", field="ttl_seconds",
                                        reason="OUT_OF_RANGE"))
    http, _ = make(Put=refusal)
    r = http.post("/v1/prompt_embeds", json={"data": b64(b"x"), "ttl_seconds": 2**40})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"ttl_seconds: must be at most 2592000, got {2**40}"
    r = http.post("/v1/prompt_embeds", json={"data": b64(b"x"), "ttl_seconds": 2**32 - 1})
    assert r.json()["error"]["message"] == "ttl_seconds: must be at most 2592000, got 4294967295"


def test_retrieve_and_delete_by_id(make: Any) -> None:
    http, stub = make(Contains=lambda req: cache_pb2.ContainsResponse(present=[req.keys[0] == "emb-1"]),
                      Delete=lambda req: cache_pb2.DeleteResponse(deleted=req.key == "emb-1"))
    assert http.get("/v1/prompt_embeds/emb-1").json() == {"id": "emb-1", "object": "prompt_embeds", "present": True}
    assert stub.last("Contains") == cache_pb2.ContainsRequest(keys=["emb-1"])
    r = http.get("/v1/prompt_embeds/emb-2")
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "id: no uploaded tensor 'emb-2' (unknown or expired)", "type": "not_found_error", "param": "id",
        "code": "embeds_id_not_found"}
    assert http.delete("/v1/prompt_embeds/emb-1").json() == {"id": "emb-1", "object": "prompt_embeds",
                                                             "deleted": True}
    assert stub.last("Delete") == cache_pb2.DeleteRequest(key="emb-1")
    r = http.delete("/v1/prompt_embeds/emb-2")
    assert r.status_code == 404 and r.json()["error"]["message"] == "id: no uploaded tensor 'emb-2'"

"""gateway/context.py: the ``Gateway`` context — ``read_json``'s body cap (by Content-Length, and while reading a
body without one), its 400s for a body that is not JSON or not an object, its ``base64_slots`` (long base64 read
already decoded; any doubt falls back to the usual parse and its error), and the channel's open/close."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pybase64
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from embedmesh.gateway import embeds_json
from embedmesh.gateway.context import Gateway, too_large
from embedmesh.gateway.embeds_json import Base64Text
from embedmesh.inference.v1 import inference_pb2_grpc
from tests.unit.gateway.conftest import bare_gateway, route_client

LIMIT = 4096


def client(limit: int = LIMIT) -> Any:
    gw = bare_gateway(max_body_bytes=limit)

    async def echo(request: Request) -> JSONResponse:
        body = await gw.read_json(request)
        return JSONResponse({"body": body, "types": {k: type(v).__name__ for k, v in body.items()}})

    async def slots(request: Request) -> JSONResponse:
        body = await gw.read_json(request, embeds_json.completion_slots)
        e = body.get("prompt_embeds")
        return JSONResponse({"decoded": type(e) is Base64Text,
                             "data": pybase64.b64encode(e.decoded).decode() if type(e) is Base64Text else e})

    return route_client([Route("/echo", echo, methods=["POST"]), Route("/slots", slots, methods=["POST"])])


def error(r: Any) -> tuple[int, str, str | None]:
    e = r.json()["error"]
    return r.status_code, e["message"], e["code"]


def test_a_json_object_is_returned_as_parsed() -> None:
    r = client().post("/echo", content=b'{"a": [1, 2.5, "x"], "b": null}')
    assert r.status_code == 200 and r.json()["body"] == {"a": [1, 2.5, "x"], "b": None}


def test_a_body_declared_over_the_limit_is_a_413_before_it_is_read() -> None:
    body = b'{"a": "' + b"x" * LIMIT + b'"}'
    assert error(client().post("/echo", content=body)) == (
        413, f"the request body is over the {LIMIT} byte limit", "body_too_large")


def test_a_body_without_a_length_is_capped_while_it_is_read() -> None:
    def chunks(size: int) -> Iterator[bytes]:
        body = b'{"a": "' + b"x" * (size - 9) + b'"}'
        for i in range(0, size, 1000):
            yield body[i:i + 1000]

    assert client().post("/echo", content=chunks(LIMIT)).json()["body"] == {"a": "x" * (LIMIT - 9)}
    r = client().post("/echo", content=chunks(LIMIT + 1))
    assert "content-length" not in r.request.headers
    assert error(r) == (413, f"the request body is over the {LIMIT} byte limit", "body_too_large")


def test_a_body_at_the_limit_is_read() -> None:
    body = b'{"a": "' + b"x" * (LIMIT - 10) + b'"}'
    assert len(body) == LIMIT - 1
    assert client().post("/echo", content=body).json()["body"] == {"a": "x" * (LIMIT - 10)}


@pytest.mark.parametrize(("body", "message"), [
    (b"{", "the request body is not valid JSON: "),
    (b"", "the request body is not valid JSON: "),
    (b"[1, 2]", "the request body must be a JSON object"),
    (b'"text"', "the request body must be a JSON object"),
])
def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes, message: str) -> None:
    status, got, code = error(client().post("/echo", content=body))
    assert (status, code) == (400, "invalid_json") and got.startswith(message)


def test_base64_slots_come_decoded_from_a_big_body() -> None:
    data = bytes(range(256)) * 8192  # 2 MiB: past MIN_BODY_BYTES once in base64
    text = pybase64.b64encode(data).decode()
    r = client(limit=8 << 20).post("/slots", content=orjson.dumps({"prompt_embeds": text}))
    assert r.json() == {"decoded": True, "data": text}
    r = client(limit=8 << 20).post("/slots", content=orjson.dumps({"prompt_embeds": text, "pad": " " * 10}))
    assert r.json()["decoded"] is True
    small = pybase64.b64encode(b"abc").decode()
    assert client().post("/slots", content=orjson.dumps({"prompt_embeds": small})).json() == {
        "decoded": False, "data": small}


@pytest.mark.parametrize("raw", [
    b'{"prompt_embeds": "' + b"QUJD" * (1 << 18) + b'"',  # truncated JSON
    b'{"prompt_embeds": "' + b"QUJD" * (1 << 18) + b'"} x',  # trailing garbage
    b'[{"prompt_embeds": "' + b"QUJD" * (1 << 18) + b'"}]',  # not an object
])
def test_with_base64_slots_a_malformed_big_body_gets_the_usual_error(raw: bytes) -> None:
    http = client(limit=8 << 20)
    assert error(http.post("/slots", content=raw)) == error(http.post("/echo", content=raw))
    assert error(http.post("/slots", content=raw))[0] == 400


def test_a_big_string_that_is_not_base64_is_parsed_as_usual() -> None:
    text = "QUJD" * (1 << 18) + "!"
    r = client(limit=8 << 20).post("/slots", content=orjson.dumps({"prompt_embeds": text}))
    assert r.json() == {"decoded": False, "data": text}


def test_too_large_names_the_limit() -> None:
    e = too_large(1234)
    assert (e.status, e.message, e.code, e.param) == (413, "the request body is over the 1234 byte limit",
                                                      "body_too_large", None)


def test_open_makes_the_channel_and_its_stubs_and_close_closes_it() -> None:
    gw: Gateway = bare_gateway()
    assert gw.channel is None and gw.stub is None
    asyncio.run(gw.close())  # before open: nothing to close

    async def cycle() -> None:
        await gw.open()
        assert gw.channel is not None
        assert isinstance(gw.stub, inference_pb2_grpc.InferenceServiceStub)
        await gw.close()

    asyncio.run(cycle())
    assert gw.config.preprocessor == "127.0.0.1:1"


def test_with_the_bypasses_off_big_base64_is_parsed_as_a_plain_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDMESH_FASTPATH", "off")
    text = pybase64.b64encode(bytes(range(256)) * 8192).decode()
    r = client(limit=8 << 20).post("/slots", content=orjson.dumps({"prompt_embeds": text}))
    assert r.json() == {"decoded": False, "data": text}

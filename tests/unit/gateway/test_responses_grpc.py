"""responses_grpc: the gRPC ResponsesService carried out by an ASGI app, here a small Starlette app standing in for
the gateway's routes (what it was asked, and what it answers), served on a real grpc.aio server. The real routes
through a real mesh: tests/e2e/test_responses_grpc.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from google.protobuf import json_format, struct_pb2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from embedmesh.gateway import responses_grpc
from embedmesh.responses.v1 import responses_pb2 as pb
from embedmesh.responses.v1 import responses_pb2_grpc as pb_grpc
from tests.support.mesh import free_port

SEEN: list[dict[str, Any]] = []
CHANNEL: list[grpc.aio.Channel] = []


async def _create(request: Request) -> Response:
    body = orjson.loads(await request.body())
    SEEN.append({"path": request.url.path, "auth": request.headers.get("authorization"), "body": body,
                 "client": request.client.host if request.client else None})
    if body.get("model") == "bad":
        err = {"error": {"message": "must be a served model", "param": "model", "type": "invalid_request_error"}}
        return Response(orjson.dumps(err), status_code=400, media_type="application/json")
    if body.get("stream") == "forever":
        async def endless() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: " + orjson.dumps({"type": "response.output_text.delta"}) + b"\n\n"
                    await asyncio.sleep(0.01)
            finally:
                SEEN.append({"stream": "ended"})
        return StreamingResponse(endless(), media_type="text/event-stream")
    if body.get("stream"):
        async def events() -> AsyncIterator[bytes]:
            for i, kind in enumerate(("response.created", "response.output_text.delta", "response.completed")):
                yield b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": i})
                yield b"\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return Response(orjson.dumps({"id": "resp_1", "object": "response", "echo": body}), media_type="application/json")


async def _one(request: Request) -> Response:
    SEEN.append({"path": request.url.path, "method": request.method, "query": str(request.query_params)})
    rid = request.path_params["id"]
    if rid != "resp_1":
        err = {"error": {"message": f"no response with id {rid!r}", "type": "not_found_error"}}
        return Response(orjson.dumps(err), status_code=404, media_type="application/json")
    if request.url.path.endswith("/input_items"):
        data = [{"id": "msg_1", "type": "message"}, {"id": "msg_2", "type": "message"}]
        return Response(orjson.dumps({"object": "list", "data": data, "first_id": "msg_1", "last_id": "msg_2",
                                      "has_more": True}), media_type="application/json")
    if request.method == "DELETE":
        return Response(orjson.dumps({"id": rid, "object": "response", "deleted": True}))
    if request.url.path.endswith("/cancel"):
        return Response(orjson.dumps({"error": {"message": "boom"}}), status_code=503)
    return Response(orjson.dumps({"id": rid, "status": "completed"}), media_type="application/json")


APP = Starlette(routes=[Route("/v1/responses", _create, methods=["POST"]),
                        Route("/v1/responses/{id}", _one, methods=["GET", "DELETE"]),
                        Route("/v1/responses/{id}/input_items", _one, methods=["GET"]),
                        Route("/v1/responses/{id}/cancel", _one, methods=["POST"])])


def _run(check: Any) -> None:
    async def main() -> None:
        free = free_port()
        server = await responses_grpc.serve(APP, "127.0.0.1", free, 1 << 20)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{free}") as ch:
                CHANNEL[:] = [ch]
                await check(pb_grpc.ResponsesServiceStub(ch))
        finally:
            await server.stop(0)

    SEEN.clear()
    asyncio.run(main())


def _struct(obj: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(obj)
    return s


def test_create_sends_the_body_with_integers_and_the_key_and_returns_the_object() -> None:
    async def check(stub: pb_grpc.ResponsesServiceStub) -> None:
        body = {"model": "m", "input": "hi", "max_output_tokens": 8, "temperature": 0.5, "n": {"deep": [3, 1.5]}}
        msgs = [m async for m in stub.CreateResponse(pb.CreateResponseRequest(body=_struct(body)),
                                                     metadata=[("authorization", "Bearer sk-x")])]
        assert len(msgs) == 1 and msgs[0].WhichOneof("result") == "response"
        assert json_format.MessageToDict(msgs[0].response)["id"] == "resp_1"
        sent = SEEN[0]
        assert sent["auth"] == "Bearer sk-x" and sent["client"] == "127.0.0.1"
        assert sent["body"] == body
        assert type(sent["body"]["max_output_tokens"]) is int and type(sent["body"]["n"]["deep"][0]) is int
        assert type(sent["body"]["temperature"]) is float

    _run(check)


def test_a_streamed_create_is_one_message_per_event_in_order() -> None:
    async def check(stub: pb_grpc.ResponsesServiceStub) -> None:
        req = pb.CreateResponseRequest(body=_struct({"model": "m", "input": "hi", "stream": True}))
        msgs = [m async for m in stub.CreateResponse(req)]
        assert [m.WhichOneof("result") for m in msgs] == ["event"] * 3
        events = [json_format.MessageToDict(m.event) for m in msgs]
        assert [e["type"] for e in events] == ["response.created", "response.output_text.delta",
                                               "response.completed"]

    _run(check)


def test_http_errors_become_grpc_codes_naming_the_field() -> None:
    async def check(stub: pb_grpc.ResponsesServiceStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.CreateResponse(pb.CreateResponseRequest(body=_struct({"model": "bad"}))):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "model: must be a served model"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id="resp_2"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "resp_2" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.CancelResponse(pb.CancelResponseRequest(response_id="resp_1"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "boom"

    _run(check)


def test_paths_and_paging_reach_the_routes() -> None:
    async def check(stub: pb_grpc.ResponsesServiceStub) -> None:
        got = await stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id="resp_1"))
        assert json_format.MessageToDict(got.response) == {"id": "resp_1", "status": "completed"}
        deleted = await stub.DeleteResponse(pb.DeleteResponseRequest(response_id="resp_1"))
        assert deleted.id == "resp_1" and deleted.deleted
        page = await stub.ListInputItems(pb.ListInputItemsRequest(response_id="resp_1", after="msg_0", limit=2,
                                                                  order="asc"))
        assert [json_format.MessageToDict(d)["id"] for d in page.data] == ["msg_1", "msg_2"]
        assert (page.first_id, page.last_id, page.has_more) == ("msg_1", "msg_2", True)
        assert SEEN[-1]["query"] == "after=msg_0&limit=2&order=asc"
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a slash cannot reach another route
            await stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id="resp_1/cancel"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        for bad, field in [(pb.ListInputItemsRequest(response_id="resp_1", limit=101), "limit"),
                           (pb.ListInputItemsRequest(response_id="resp_1", order="up"), "order"),
                           (pb.ListInputItemsRequest(), "response_id")]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ListInputItems(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)

    _run(check)


def _ld(tag: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    n, size = len(payload), b""
    while True:
        low, n = n & 0x7F, n >> 7
        size += bytes([low | (0x80 if n else 0)])
        if not n:
            return bytes([tag]) + size + payload


def test_bytes_that_are_not_the_request_are_invalid_argument_not_unknown() -> None:
    nested = b""
    for _ in range(200):  # Struct{"a": Value{struct_value: ...}} 200 deep: past protobuf's depth limit
        nested = _ld(0x0A, _ld(0x0A, b"\x01a") + _ld(0x12, _ld(0x2A, nested)))

    async def check(stub: pb_grpc.ResponsesServiceStub) -> None:
        ch = CHANNEL[0]
        create = ch.unary_stream("/embedmesh.responses.v1.ResponsesService/CreateResponse")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in create(_ld(0x0A, nested)):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request: ")
        retrieve = ch.unary_unary("/embedmesh.responses.v1.ResponsesService/RetrieveResponse")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await retrieve(b"\xff\xff\xff")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request: ")
        assert SEEN == []  # nothing reached the routes

    _run(check)


def test_a_caller_that_cancels_a_stream_ends_the_request() -> None:
    async def check(stub: pb_grpc.ResponsesServiceStub) -> None:
        call = stub.CreateResponse(pb.CreateResponseRequest(body=_struct({"model": "m", "stream": "forever"})))
        first = await call.read()
        assert json_format.MessageToDict(first.event)["type"] == "response.output_text.delta"
        call.cancel()
        for _ in range(200):
            if {"stream": "ended"} in SEEN:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the route's stream kept running after the caller cancelled")

    _run(check)

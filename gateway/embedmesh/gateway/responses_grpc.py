"""``embedmesh.responses.v1.ResponsesService``: the Responses API over gRPC, served by the gateway process on
``--grpc-port`` (0, the default: not served).

Each call is carried out by the REST app's own ``/v1/responses`` handlers, called in process as an ASGI request
(no socket, no second copy of the rules): the same admission, API-key check and tenant, the same request checks,
the same response store. So a response created over REST is retrieved over gRPC and the other way round, and another
tenant's id is NOT_FOUND exactly as it is a 404 over REST. The gRPC side only moves JSON into and out of
``google.protobuf.Struct`` and an HTTP status into a gRPC code (the message names the field, as the REST error's
``param`` does).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode

import grpc
import orjson
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from embedmesh.core.server import add_public_health, add_public_reflection, server_options
from embedmesh.responses.v1 import responses_pb2 as pb
from embedmesh.responses.v1 import responses_pb2_grpc as pb_grpc

__all__ = ["ResponsesServicer", "serve", "SERVICE"]

SERVICE = "embedmesh.responses.v1.ResponsesService"

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          405: grpc.StatusCode.UNIMPLEMENTED, 409: grpc.StatusCode.FAILED_PRECONDITION,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 422: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
          502: grpc.StatusCode.UNAVAILABLE, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_ORDERS = ("", "asc", "desc")


class _Answer:
    """What the REST handler answered: status, content type and the body's chunks as they come."""

    def __init__(self) -> None:
        self.status = 0
        self.content_type = ""
        self.started = asyncio.Event()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()


async def _asgi(app: Any, method: str, path: str, query: str, body: bytes, headers: list[tuple[bytes, bytes]],
                client: tuple[str, int], answer: _Answer) -> None:
    """One in-process request to ``app``; its answer goes to ``answer`` (``None`` in ``chunks`` ends it)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "2", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"content-length", str(len(body)).encode()), *headers], "client": client,
             "server": ("grpc", 0), "state": {}}
    sent = False
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.content_type = dict(message.get("headers") or []).get(b"content-type", b"").decode()
            answer.started.set()
        elif message["type"] == "http.response.body":
            if message.get("body"):
                answer.chunks.put_nowait(message["body"])
            if not message.get("more_body"):
                answer.chunks.put_nowait(None)

    try:
        await app(scope, receive, send)
    finally:
        gone.set()
        answer.started.set()
        answer.chunks.put_nowait(None)


def _integral(value: Any) -> Any:
    """A Struct's JSON with integral doubles as integers (a Struct has only doubles; the REST models want ints)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def _struct(obj: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(obj)
    return s


def _client(context: grpc.aio.ServicerContext) -> tuple[str, int]:
    """The caller's address as the REST app's per-IP limits read it."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            return host, int(port)
        except ValueError:
            pass
    return "127.0.0.1", 0


class ResponsesServicer(pb_grpc.ResponsesServiceServicer):
    """The RPCs, each one REST request to ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def _request(self, context: grpc.aio.ServicerContext, method: str, path: str, query: str = "",
                       body: bytes = b"") -> tuple[_Answer, asyncio.Task[None]]:
        headers = [(b"content-type", b"application/json")]
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                headers.append((b"authorization", value.encode()))
        answer = _Answer()
        task = asyncio.get_running_loop().create_task(
            _asgi(self.app, method, path, query, body, headers, _client(context), answer))
        await answer.started.wait()
        return answer, task

    async def _json(self, context: grpc.aio.ServicerContext, method: str, path: str, query: str = "",
                    body: bytes = b"") -> dict[str, Any]:
        answer, task = await self._request(context, method, path, query, body)
        try:
            data = await _whole(answer)
            await task
        finally:  # the caller went away (cancel, deadline): so does the request
            if not task.done():
                task.cancel()
        return await _checked(context, answer.status, data)

    async def CreateResponse(self, request: pb.CreateResponseRequest,  # noqa: N802 (gRPC's method name)
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CreateResponseResponse]:
        body = _integral(json_format.MessageToDict(request.body)) if request.HasField("body") else {}
        answer, task = await self._request(context, "POST", "/v1/responses", body=orjson.dumps(body))
        try:
            if answer.status != 200 or not answer.content_type.startswith("text/event-stream"):
                data = await _whole(answer)
                obj = await _checked(context, answer.status, data)
                yield pb.CreateResponseResponse(response=_struct(obj))
                return
            async for event in _events(answer):
                yield pb.CreateResponseResponse(event=_struct(event))
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def RetrieveResponse(self, request: pb.RetrieveResponseRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.RetrieveResponseResponse:
        obj = await self._json(context, "GET", await _path(context, request.response_id))
        return pb.RetrieveResponseResponse(response=_struct(obj))

    async def DeleteResponse(self, request: pb.DeleteResponseRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.DeleteResponseResponse:
        obj = await self._json(context, "DELETE", await _path(context, request.response_id))
        return pb.DeleteResponseResponse(id=obj["id"], deleted=bool(obj["deleted"]))

    async def ListInputItems(self, request: pb.ListInputItemsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.ListInputItemsResponse:
        if request.order not in _ORDERS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"order: must be 'asc' or 'desc', got "
                                                                  f"{request.order[:64]!r}")
        if not 0 <= request.limit <= 100:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: must be in [1, 100] (0: the default, 20)")
        query = {k: v for k, v in (("after", request.after), ("before", request.before),
                                   ("limit", str(request.limit) if request.limit else ""),
                                   ("order", request.order)) if v}
        path = await _path(context, request.response_id) + "/input_items"
        obj = await self._json(context, "GET", path, urlencode(query))
        return pb.ListInputItemsResponse(data=[_struct(x) for x in obj["data"]], first_id=obj.get("first_id") or "",
                                         last_id=obj.get("last_id") or "", has_more=bool(obj.get("has_more")))

    async def CancelResponse(self, request: pb.CancelResponseRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.CancelResponseResponse:
        obj = await self._json(context, "POST", await _path(context, request.response_id) + "/cancel")
        return pb.CancelResponseResponse(response=_struct(obj))


async def _path(context: grpc.aio.ServicerContext, rid: str) -> str:
    if not rid:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "response_id: required")
    if len(rid) > 256:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "response_id: at most 256 characters")
    return "/v1/responses/" + quote(rid, safe="")


async def _whole(answer: _Answer) -> bytes:
    parts = []
    while (chunk := await answer.chunks.get()) is not None:
        parts.append(chunk)
    return b"".join(parts)


async def _checked(context: grpc.aio.ServicerContext, status: int, data: bytes) -> dict[str, Any]:
    """The JSON of a 200, else the call ends with the gRPC code of ``status`` and the REST error's words."""
    try:
        obj = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        obj = {}
    if status == 200 and isinstance(obj, dict):
        return obj
    err = obj.get("error") if isinstance(obj, dict) else None
    err = err if isinstance(err, dict) else {}
    message = str(err.get("message") or f"HTTP {status}")
    param = err.get("param")
    if param and not message.startswith(str(param)):
        message = f"{param}: {message}"
    code = _CODES.get(status, grpc.StatusCode.INTERNAL if status >= 500 or status == 200 else
                      grpc.StatusCode.INVALID_ARGUMENT)
    await context.abort(code, message)
    raise AssertionError("abort returns only by raising")  # pragma: no cover


async def _events(answer: _Answer) -> AsyncIterator[dict[str, Any]]:
    """The SSE stream's events, each the JSON of its ``data:`` line."""
    buf = b""
    while (chunk := await answer.chunks.get()) is not None:
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            for line in frame.split(b"\n"):
                if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                    yield orjson.loads(line[6:])


def _parsed(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with its request parsed in the call: bytes that are not the request message (or nest deeper
    than protobuf reads) are INVALID_ARGUMENT naming ``request``, not gRPC's UNKNOWN."""
    parse = handler.request_deserializer

    async def read(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends: the client's bytes, not a bug here
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: the bytes sent to {method} are not a "
                                                                  f"valid protobuf message of its request type "
                                                                  f"({type(e).__name__})")

    if handler.unary_stream is not None:
        fn = handler.unary_stream

        async def streamed(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await read(raw, context)
            async for out in fn(request, context):
                yield out

        return grpc.unary_stream_rpc_method_handler(streamed, response_serializer=handler.response_serializer)
    unary = handler.unary_unary

    async def once(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await unary(await read(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(once, response_serializer=handler.response_serializer)


class _Registrar:
    """Stands in for the server while the generated ``add_ResponsesServiceServicer_to_server`` registers: each
    method handler is registered parsing its own request (``_parsed``)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """The same handlers come to ``add_registered_method_handlers`` too; these are dropped."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: _parsed(h, f"/{service}/{name}") for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self.server.add_registered_method_handlers(service, wrapped)


async def serve(app: Any, host: str, port: int, max_message_bytes: int) -> grpc.aio.Server:
    """Start ``ResponsesService`` for ``app`` on ``host:port``, with health (open, reads bounded per address) and
    reflection (for callers with an API key: grpcurl lists and describes it); the caller stops it."""
    server = grpc.aio.server(options=server_options(max_message_bytes))
    pb_grpc.add_ResponsesServiceServicer_to_server(ResponsesServicer(app), _Registrar(server))  # type: ignore[arg-type]
    # A client-facing port like the preprocessor's public one: health open to probes with its reads bounded per
    # address, reflection read only after the API key (core/inbound.py).
    checks = add_public_health(server)
    for name in ("", SERVICE):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    add_public_reflection(server, [SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME])
    if not server.add_insecure_port(f"{host}:{port}"):
        raise OSError(f"grpc_port: cannot listen on {host}:{port}")
    await server.start()
    return server

"""The Starlette app: routes, the gRPC channel to the preprocessor, SSE streaming, health, metrics, tracing.

Streaming: the first event is awaited before the HTTP response starts, so a request the preprocessor rejects is a
plain 400 JSON, not a broken stream. When the HTTP client goes away, Starlette cancels the body iterator; its
``finally`` cancels the gRPC call, which cancels the preprocessor's calls to the workers, which abort generation.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from embedmesh.core.server import insecure_channel
from embedmesh.core.telemetry import tracer
from embedmesh.gateway.config import GatewayConfig
from embedmesh.gateway.embeddings import embedding_routes
from embedmesh.gateway.errors import ApiError, error_response, from_grpc
from embedmesh.gateway.translate import FINISH, chat_params, completion_params, require_object, usage_json
from embedmesh.gateway.uploads import upload_routes
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc

__all__ = ["create_app", "Gateway"]

REQUESTS = Counter("embedmesh_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
LATENCY = Histogram("embedmesh_gateway_request_duration_seconds", "Time to the response head (whole body for "
                    "non-streamed responses)", ["route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
INFLIGHT = Gauge("embedmesh_gateway_inflight_requests", "Requests being handled (streams until they end)")
DISCONNECTS = Counter("embedmesh_gateway_stream_disconnects_total", "Streams the client left before the end")


class Gateway:
    """Holds the channel and stubs; route handlers are its methods."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.channel: grpc.aio.Channel | None = None
        self.stub: inference_pb2_grpc.InferenceServiceStub | None = None
        self.health: health_pb2_grpc.HealthStub | None = None

    async def open(self) -> None:
        self.channel = insecure_channel(self.config.preprocessor)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def read_json(self, request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise ApiError(413, f"request body over the {self.config.max_body_bytes} byte limit",
                           code="body_too_large")
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            raise ApiError(413, f"request body over the {self.config.max_body_bytes} byte limit",
                           code="body_too_large")
        try:
            return require_object(orjson.loads(raw))
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    # --- completions and chat ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        params = completion_params(body)
        return await self._generate(body, params, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        params = chat_params(body)
        return await self._generate(body, params, chat=True)

    async def _generate(self, body: dict[str, Any], params: Any, *, chat: bool) -> Response:
        assert self.stub is not None
        timeout = self.config.request_timeout_seconds
        created = int(time.time())
        if not body.get("stream"):
            try:
                if chat:
                    resp = await self.stub.Chat(inference_pb2.ChatRequest(params=params), timeout=timeout)
                else:
                    resp = await self.stub.Complete(inference_pb2.CompleteRequest(params=params), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
            return _json(_whole(resp, created, chat))
        if chat:
            call = self.stub.StreamChat(inference_pb2.StreamChatRequest(params=params), timeout=timeout)
        else:
            call = self.stub.StreamComplete(inference_pb2.StreamCompleteRequest(params=params), timeout=timeout)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _sse(call, first, created, chat, include_usage),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    async def models(self, request: Request) -> Response:
        assert self.stub is not None
        try:
            resp = await self.stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        data = [
            {
                "id": m.id, "object": "model", "created": m.created, "owned_by": "embedmesh",
                "max_model_len": m.max_context_tokens, "hidden_size": m.hidden_size,
                "task": m.task or "generate", "ready_workers": m.ready_workers,
            }
            for m in resp.models
        ]
        return _json({"object": "list", "data": data})

    async def health_check(self, request: Request) -> Response:
        assert self.health is not None
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        except grpc.aio.AioRpcError as e:
            return _json({"status": "unavailable", "detail": f"preprocessor unreachable: {e.code().name}"}, 503)
        if r.status == health_pb2.HealthCheckResponse.SERVING:
            return _json({"status": "ok"})
        return _json({"status": "unavailable",
                      "detail": "the mesh is starting or draining (preprocessor or workers not SERVING)"}, 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _whole(resp: Any, created: int, chat: bool) -> dict[str, Any]:
    if chat:
        choices: list[dict[str, Any]] = [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "finish_reason": FINISH[c.finish_reason], "logprobs": None}
            for c in resp.choices
        ]
        obj = "chat.completion"
    else:
        choices = [{"index": c.index, "text": c.text, "finish_reason": FINISH[c.finish_reason], "logprobs": None}
                   for c in resp.choices]
        obj = "text_completion"
    return {"id": resp.id, "object": obj, "created": created, "model": resp.model, "choices": choices,
            "usage": usage_json(resp.usage)}


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _sse(call: Any, first: Any, created: int, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunk shapes; exactly one finish_reason per choice; usage chunk on request; then [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    started: set[int] = set()
    finished = False
    INFLIGHT.inc()
    try:
        ev = first
        while ev is not grpc.aio.EOF:
            if ev.HasField("usage"):
                if include_usage:
                    yield _event({"id": ev.id, "object": obj, "created": created, "model": ev.model, "choices": [],
                                  "usage": usage_json(ev.usage)})
            else:
                finish = FINISH[ev.finish_reason]
                if chat:
                    if ev.index not in started:
                        started.add(ev.index)
                        yield _event({"id": ev.id, "object": obj, "created": created, "model": ev.model,
                                      "choices": [{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None, "logprobs": None}],
                                      **({"usage": None} if include_usage else {})})
                    delta = {"content": ev.text} if ev.text else {}
                    choice = {"index": ev.index, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": ev.index, "text": ev.text, "finish_reason": finish, "logprobs": None}
                if ev.text or finish:
                    yield _event({"id": ev.id, "object": obj, "created": created, "model": ev.model,
                                  "choices": [choice], **({"usage": None} if include_usage else {})})
            ev = await call.read()
        finished = True
        yield b"data: [DONE]\n\n"
    except grpc.aio.AioRpcError as e:
        finished = True
        err = from_grpc(e)
        yield _event(err.body())
        yield b"data: [DONE]\n\n"
    finally:
        INFLIGHT.dec()
        if not finished:
            DISCONNECTS.inc()
        call.cancel()


Handler = Callable[[Request], Awaitable[Response]]


def _observed(route: str, handler: Handler) -> Handler:
    """Metrics, a server span (parented by an incoming W3C traceparent) and OpenAI errors for one route."""

    async def wrapped(request: Request) -> Response:
        t0 = time.perf_counter()
        ctx = propagate.extract(dict(request.headers))
        with tracer().start_as_current_span(f"gateway {request.method} {route}", context=ctx,
                                            kind=trace.SpanKind.SERVER,
                                            attributes={"http.route": route}) as span:
            try:
                response = await handler(request)
            except ApiError as e:
                response = error_response(e)
                span.set_status(trace.Status(trace.StatusCode.ERROR, e.message[:200]))
            span.set_attribute("http.status_code", response.status_code)
        REQUESTS.labels(route, str(response.status_code)).inc()
        LATENCY.labels(route).observe(time.perf_counter() - t0)
        return response

    return wrapped


def create_app(config: GatewayConfig, extra_routes: list[Route] | None = None) -> Starlette:
    """The app; ``extra_routes`` lets feature modules (embeddings, files, vector stores) plug in."""
    gw = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.open()
        yield
        await gw.close()

    routes = [
        Route("/v1/completions", _observed("/v1/completions", gw.completions), methods=["POST"]),
        Route("/v1/chat/completions", _observed("/v1/chat/completions", gw.chat_completions), methods=["POST"]),
        Route("/v1/models", _observed("/v1/models", gw.models), methods=["GET"]),
        Route("/health", gw.health_check, methods=["GET"]),
        Route("/metrics", gw.metrics, methods=["GET"]),
    ]
    for r in [*upload_routes(gw), *embedding_routes(gw), *(extra_routes or [])]:
        routes.append(Route(r.path, _observed(r.path, r.endpoint), methods=list(r.methods or ["GET"])))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                                       code=kind, type_=kind))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.gateway = gw
    app.state.request_id = lambda: uuid.uuid4().hex
    return app

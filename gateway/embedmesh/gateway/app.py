"""The Starlette app: one gRPC channel to the preprocessor, the route modules, health, metrics, OpenAI errors.

Routes come from one module per API area, each with the same ``routes(gw: Gateway) -> list[Route]`` function bound
to the ``Gateway`` (``context.py``: channel, stubs, config, body reading)::

    completions.py   POST /v1/completions, POST /v1/chat/completions (JSON or SSE)
    embeddings.py    POST /v1/embeddings
    uploads.py       /v1/prompt_embeds (upload a tensor once, refer to it by id)
    app.py           GET /v1/models, GET /health, GET /metrics
    openapi.py       GET /openapi.json, GET /docs (built from the app's own routes)

A new area (``/v1/files``, ``/v1/vector_stores``, ``lora.py``) is a new module with its own ``routes(gw)``
function, listed in ``create_app`` or passed in ``extra_routes``. Every route gets the same wrapper: request count
by route and status, latency, the in-flight gauge, a server span, and OpenAI error JSON for ``ApiError`` and
unexpected errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core import auth
from embedmesh.core.logs import get_logger
from embedmesh.core.telemetry import tracer
from embedmesh.gateway import completions, embeddings, lora, openapi, responses, uploads
from embedmesh.gateway.auth import authenticate_request, forwarding_channel
from embedmesh.gateway.config import GatewayConfig
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.errors import ApiError, error_response, from_grpc
from embedmesh.gateway.metrics import INFLIGHT, LATENCY, REQUESTS
from embedmesh.gateway.sse import EventStream
from embedmesh.inference.v1 import inference_pb2

__all__ = ["create_app", "Gateway"]

log = get_logger("embedmesh.gateway")

_HEALTH_TIMEOUT_S = 3.0
_MODELS_TIMEOUT_S = 10.0


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def mesh_routes(gw: Gateway) -> list[Route]:
    """``/v1/models`` and ``/health``."""

    async def models(request: Request) -> Response:
        try:
            resp = await gw.stub.ListModels(inference_pb2.ListModelsRequest(), timeout=_MODELS_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return _json({"object": "list", "data": [
            {"id": m.id, "object": "model", "created": m.created, "owned_by": "embedmesh",
             "max_model_len": m.max_context_tokens, "hidden_size": m.hidden_size,
             "task": m.task or "generate", "ready_workers": m.ready_workers,
             **({"parent": m.parent, "root": m.parent} if m.parent else {"parent": None, "root": m.id})}
            for m in resp.models
        ]})

    vs_health: list[health_pb2_grpc.HealthStub] = []
    asking: list[asyncio.Task[tuple[dict[str, Any], int]]] = []
    """The mesh's health being asked now, shared by every /health request that arrives meanwhile."""

    async def health(request: Request) -> Response:
        """Every service of the mesh (gateway, preprocessor, workers, routers, vector store), each ``serving``,
        ``degraded`` or ``down``; 200 while the inference path works (the preprocessor serves), else 503.
        ``status`` is ``ok`` when everything serves, ``degraded`` when inference works with something missing.

        /health is open (probes carry no key): requests that arrive while the mesh is being asked share that one
        round of calls (each answer comes from a round under way when its request arrived, never a remembered
        one), so any number of callers cost the mesh at most one
        round in flight, not one per request."""
        if not asking:
            task = asyncio.ensure_future(_mesh_view())
            asking.append(task)
            task.add_done_callback(lambda _: asking.remove(task))
        body, status = await asyncio.shield(asking[0])  # a caller that leaves does not cancel the others' answer
        return _json(body, status)

    async def _mesh_view() -> tuple[dict[str, Any], int]:
        if gw.config.vector_store and not vs_health:
            vs_health.append(health_pb2_grpc.HealthStub(forwarding_channel(gw.config.vector_store)))
        services: list[dict[str, str]] = [{"service": "gateway", "name": "gateway", "status": "serving"}]
        pre, mesh, vs = await asyncio.gather(_preprocessor_health(gw), _mesh_services(gw),
                                             _vector_store_health(vs_health[0] if vs_health else None))
        if pre["status"] == "serving" and mesh and mesh[0].get("service") == "preprocessor":
            pre = mesh[0]  # the preprocessor's own view: degraded when a worker or router is missing
        services.append(pre)
        services.extend(s for s in mesh if s.get("service") != "preprocessor")
        if vs is not None:
            services.append(vs)
        if pre["status"] == "down":
            return {"status": "unavailable", "detail": pre.get("detail", ""), "services": services}, 503
        degraded = any(s["status"] != "serving" for s in services)
        return {"status": "degraded" if degraded else "ok", "services": services}, 200

    return [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"])]


def _entry(service: str, status: str, detail: str = "", **more: str) -> dict[str, str]:
    out = {"service": service, "name": more.pop("name", service), "status": status, **more}
    if detail:
        out["detail"] = detail
    return out


async def _preprocessor_health(gw: Gateway) -> dict[str, str]:
    try:
        r = await gw.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=_HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return _entry("preprocessor", "down", f"preprocessor unreachable ({e.code().name})")
    if r.status == health_pb2.HealthCheckResponse.SERVING:
        return _entry("preprocessor", "serving")
    return _entry("preprocessor", "down", "the preprocessor is not SERVING (starting, draining or waiting for "
                                          "workers)")


async def _mesh_services(gw: Gateway) -> list[dict[str, str]]:
    """What the preprocessor knows (itself, workers, routers); empty when it cannot say (unreachable, older)."""
    try:
        r = await gw.stub.GetMeshHealth(inference_pb2.GetMeshHealthRequest(), timeout=_HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return []
    out = []
    for s in r.services:
        extra = {"model": s.model} if s.model else {}
        out.append(_entry(s.service, s.status, s.detail, name=s.name, **extra))
    return out


async def _vector_store_health(stub: health_pb2_grpc.HealthStub | None) -> dict[str, str] | None:
    if stub is None:
        return None
    try:
        r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return _entry("vector-store", "down", f"vector store unreachable ({e.code().name})")
    if r.status == health_pb2.HealthCheckResponse.SERVING:
        return _entry("vector-store", "serving")
    return _entry("vector-store", "down", "the vector store is not SERVING")


Handler = Callable[[Request], Awaitable[Response]]


class _Admission:
    """Requests in flight at this gateway, all routes together (a stream counts until its last byte). Past the
    limit a request is refused at once with 503 + Retry-After, before its body is read or any gRPC call is made:
    under overload the queue must not build up here, ahead of the preprocessor's own bound.

    With API keys, each tenant is counted too, and checked first: a tenant holding its share of the slots
    (``tenant_share`` of the limit, or its key's ``max_concurrent_requests`` when lower) gets 429 at once and takes
    no slot, so one tenant — slow bodies, a flood — can occupy at most its share and never the whole gateway.
    """

    def __init__(self, limit: int, tenant_share: float = 1.0) -> None:
        self.limit = limit
        self.count = 0
        self.share = max(1, int(limit * tenant_share)) if limit else 0
        self.tenants: dict[str, int] = {}

    def _cap(self, key: auth.ApiKey) -> int:
        """How many requests one tenant may have in flight here; 0 = no bound of its own."""
        caps = [c for c in (self.share, key.max_concurrent_requests) if c]
        return min(caps) if caps else 0

    def enter(self, principal: auth.Principal | None) -> Callable[[], None]:
        """Take a slot for the request of ``principal`` (None: no key needed) or raise the refusal; returns the
        release."""
        tenant = principal.tenant if principal is not None and principal.key is not None else None
        if tenant is not None:
            held = self.tenants.get(tenant, 0)
            cap = self._cap(principal.key)  # type: ignore[union-attr]
            if cap and held >= cap:
                raise ApiError(429, f"tenant {tenant!r} has {held} requests in flight at this gateway, its share; "
                                    "retry when one finishes", code="rate_limit_exceeded", type_="rate_limit_error",
                               retry_after=1.0)
        if self.limit and self.count >= self.limit:
            raise ApiError(503, f"the gateway has {self.count} requests in flight, its limit; retry shortly",
                           code="overloaded", type_="service_unavailable", retry_after=1.0)
        self.count += 1
        if tenant is None:
            return self._release

        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1

        def release() -> None:
            self.count -= 1
            left = self.tenants[tenant] - 1
            if left:
                self.tenants[tenant] = left
            else:
                del self.tenants[tenant]  # bounded by the tenants with requests in flight, not by every key seen

        return release

    def _release(self) -> None:
        self.count -= 1


def _observed(route: str, handler: Handler, *, traced: bool = True, metrics_require_key: bool = False,
              admission: _Admission | None = None) -> Handler:
    """Admission, API key check, metrics, a server span (parented by an incoming W3C traceparent) and OpenAI errors
    for one route."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except Exception:  # noqa: BLE001 - a bug in a handler is a 500 in OpenAI's shape, with no internals
            log.exception("unhandled error", extra={"route": route})
            return error_response(ApiError(500, "internal server error", code="internal_error"))

    async def wrapped(request: Request) -> Response:
        t0 = time.perf_counter()
        release: Callable[[], None] | None = None
        try:
            # The key first (headers only), then admission by tenant and for the gateway: all before the body.
            principal = authenticate_request(request, metrics_require_key)
            if admission is not None:
                release = admission.enter(principal)
        except ApiError as e:
            REQUESTS.labels(route, str(e.status)).inc()
            return error_response(e)
        INFLIGHT.inc()
        response: Response | None = None
        try:
            if traced:
                ctx = propagate.extract(request.headers)
                with tracer().start_as_current_span(f"gateway {request.method} {route}", context=ctx,
                                                    kind=trace.SpanKind.SERVER,
                                                    attributes={"http.route": route}) as span:
                    response = await run(request)
                    span.set_attribute("http.status_code", response.status_code)
                    if response.status_code >= 400:
                        span.set_status(trace.Status(trace.StatusCode.ERROR, str(response.status_code)))
            else:
                response = await run(request)
        finally:
            if isinstance(response, EventStream):
                response.on_close.append(INFLIGHT.dec)  # a stream is in flight until its last byte
                if release is not None:
                    response.on_close.append(release)
            else:
                INFLIGHT.dec()
                if release is not None:
                    release()
        REQUESTS.labels(route, str(response.status_code)).inc()
        LATENCY.labels(route).observe(time.perf_counter() - t0)
        return response

    wrapped.__wrapped__ = handler  # type: ignore[attr-defined]  # the bare handler (batch lines call it)
    return wrapped


async def _metrics(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


_HTTP_KIND = {404: "not_found_error", 405: "invalid_request_error"}


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown routes (404) and wrong methods (405) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(status, str(exc.detail))
    kind = _HTTP_KIND.get(status, "invalid_request_error")
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(status)
    return Response(orjson.dumps(ApiError(status, message, code=code, type_=kind).body()), status_code=status,
                    media_type="application/json", headers=exc.headers)


RouteFactory = Callable[["Gateway"], list[Route]]


def create_app(config: GatewayConfig, extra_routes: Sequence[Route | RouteFactory] = ()) -> Starlette:
    """The gateway app. ``extra_routes`` plugs in more API areas: routes, or functions ``(gateway) -> routes``
    (the shape of every route module's ``routes``, e.g. ``files.routes`` and ``vector_stores.routes``)."""
    gw = Gateway(config)
    admission = _Admission(config.max_inflight, config.tenant_share)

    # The Batch API (batches.py): its runner works below the interactive requests admitted here.
    from embedmesh.gateway import batches as batch_api

    batch = batch_api.Batches(gw, inflight=lambda: admission.count)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.open()
        await batch.open()
        grpc_server = None
        if config.grpc_port:  # the Responses API over gRPC, carried out by this app (responses_grpc.py)
            from embedmesh.gateway import responses_grpc

            grpc_server = await responses_grpc.serve(app, config.host, config.grpc_port, config.max_body_bytes)
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(5)
            await batch.close()
            await gw.close()

    # Files and vector stores share one client to the VectorStoreService (501 when --vector-store is unset).
    from embedmesh.gateway import files, vector_stores

    vs_client = vector_stores.VectorStoreClient(gw)
    plugged: list[Route] = [*files.routes(gw, vs_client, batch), *vector_stores.routes(gw, vs_client),
                            *batch_api.routes(gw, batch)]
    for extra in extra_routes:
        plugged.extend([extra] if isinstance(extra, Route) else extra(gw))
    routes: list[Route] = []
    for r in [*completions.routes(gw), *mesh_routes(gw), *uploads.routes(gw), *embeddings.routes(gw),
              *lora.routes(gw), *responses.routes(gw), *openapi.routes(gw), *plugged]:
        traced = r.path != "/health"  # probes would drown the traces
        routes.append(Route(r.path, _observed(r.path, r.endpoint, traced=traced,
                                              admission=None if r.path == "/health" else admission),
                            methods=list(r.methods or ["GET"])))
    metrics = _observed("/metrics", _metrics, traced=False, metrics_require_key=config.metrics_require_key)
    routes.append(Route("/metrics", metrics if config.metrics_require_key else _metrics, methods=["GET"]))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    # Batch lines go to the very handlers of the routes they name, without this app's admission and metrics.
    batch.handlers = {r.path: r.endpoint.__wrapped__ for r in routes
                      if r.path in batch_api.batch_lines.BATCH_URLS and "POST" in (r.methods or ())}
    app.state.gateway = gw
    return app

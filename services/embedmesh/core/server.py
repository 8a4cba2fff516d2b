"""One server bootstrap for every service: grpc.aio server, message-size limits, health, reflection,
the error interceptor, and a graceful drain on SIGTERM/SIGINT.

Health: every registered service name (and "" for the whole server) starts NOT_SERVING; the service flips
itself to SERVING once loaded (``Server.set_serving``) and everything goes back to NOT_SERVING when draining,
so load balancers stop sending before the port closes.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from embedmesh.core.errors import EmbedmeshError, InternalError, to_status
from embedmesh.core.logs import get_logger
from embedmesh.core.telemetry import (
    RPC_LATENCY,
    RPC_REQUESTS,
    TracingClientInterceptor,
    extract_context,
    service_name,
    tracer,
)

__all__ = ["ServerOptions", "Server", "channel_options", "insecure_channel", "ErrorInterceptor", "LIVENESS"]

LIVENESS = "embedmesh.Liveness"
"""Health name that is SERVING while the process runs (for liveness probes): readiness names go NOT_SERVING
when a dependency is missing, and restarting the process would not bring that dependency back."""

log = get_logger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 0
    """TCP port; 0 picks a free one (the bound port is on ``Server.port``)."""
    max_message_bytes: int = 512 * MiB
    """Largest gRPC message sent or received (gRPC's own default is 4 MiB)."""
    grace_seconds: float = float(os.environ.get("EMBEDMESH_DRAIN_GRACE_SECONDS", "5"))
    """How long in-flight calls may finish after a drain starts (EMBEDMESH_DRAIN_GRACE_SECONDS)."""
    metrics_port: int = 0
    """Port of the Prometheus /metrics endpoint; 0 = none."""


def channel_options(max_message_bytes: int = 512 * MiB) -> list[tuple[str, Any]]:
    """Options every channel and server uses, so large tensors are not refused at 4 MiB."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def insecure_channel(address: str, max_message_bytes: int = 512 * MiB) -> grpc.aio.Channel:
    """An aio channel to another mesh service with the mesh's options."""
    return grpc.aio.insecure_channel(
        address, options=channel_options(max_message_bytes), interceptors=TracingClientInterceptor()
    )


async def _abort(context: grpc.aio.ServicerContext, err: EmbedmeshError) -> None:
    await context.abort_with_status(to_status(err))


def _unexpected(exc: BaseException, method: str) -> InternalError:
    incident = uuid.uuid4().hex[:12]
    log.error("unhandled error", exc_info=exc, extra={"method": method, "incident": incident})
    return InternalError(f"internal error (incident {incident}); see the service log")


class _Observed:
    """One RPC's span, status code and latency."""

    def __init__(self, method: str, metadata: Any) -> None:
        self.method = method.rsplit("/", 1)[-1]
        self.full = method
        self.code = "OK"
        self._span_cm = tracer().start_as_current_span(
            f"{service_name()} {self.method}", context=extract_context(metadata), kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method},
        )
        self._t0 = time.perf_counter()

    def __enter__(self) -> _Observed:
        self.span = self._span_cm.__enter__()
        return self

    def fail(self, code: str) -> None:
        self.code = code
        self.span.set_attribute("rpc.grpc.status_code", code)
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, code))

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None and issubclass(exc[0], asyncio.CancelledError | GeneratorExit):
            self.code = "CANCELLED"
        self._span_cm.__exit__(None, None, None)
        RPC_REQUESTS.labels(service_name(), self.method, self.code).inc()
        RPC_LATENCY.labels(service_name(), self.method).observe(time.perf_counter() - self._t0)


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str, metadata: Any) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _Observed(method, metadata) as obs:
            try:
                return await fn(request, context)
            except EmbedmeshError as e:
                obs.fail(e.code.name)
                await _abort(context, e)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:  # noqa: BLE001 - the one place unexpected errors become INTERNAL
                obs.fail("INTERNAL")
                await _abort(context, _unexpected(e, method))

    return wrapper


def _wrap_stream(
    fn: Callable[..., AsyncIterator[Any]], method: str, metadata: Any
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with _Observed(method, metadata) as obs:
            try:
                async for item in fn(request, context):
                    yield item
            except EmbedmeshError as e:
                obs.fail(e.code.name)
                await _abort(context, e)
            except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as e:  # noqa: BLE001
                obs.fail("INTERNAL")
                await _abort(context, _unexpected(e, method))

    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain exceptions to status codes with details (anything else becomes INTERNAL with an incident id),
    and gives every RPC a server span (parented by the caller's traceparent) and Prometheus counts/latency."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        md = handler_call_details.invocation_metadata
        # Health and reflection handle their own errors and are not traced (probes would drown the traces).
        if method.startswith("/grpc.health") or method.startswith("/grpc.reflection"):
            return handler
        kw = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method, md), **kw)
        if handler.unary_stream:
            fn = handler.unary_stream
            if inspect.isasyncgenfunction(fn):
                return grpc.unary_stream_rpc_method_handler(_wrap_stream(fn, method, md), **kw)
            return handler
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, method, md), **kw)
        if handler.stream_stream:
            fn = handler.stream_stream
            if inspect.isasyncgenfunction(fn):
                return grpc.stream_stream_rpc_method_handler(_wrap_stream(fn, method, md), **kw)
        return handler


class Server:
    """A service's gRPC server with health, reflection and drain.

    Usage::

        server = Server("preprocessor", options)
        server.add(add_InferenceServiceServicer_to_server, servicer, "embedmesh.inference.v1.InferenceService")
        await server.start()
        ... load ...
        server.set_serving(True)
        await server.wait_for_termination()   # returns after SIGTERM/SIGINT and a graceful stop
    """

    def __init__(self, name: str, options: ServerOptions) -> None:
        self.name = name
        self.options = options
        self._server = grpc.aio.server(
            interceptors=[ErrorInterceptor()], options=channel_options(options.max_message_bytes)
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._service_names: list[str] = []
        self.port = 0
        self._stopped = asyncio.Event()
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str) -> None:
        """Register a servicer under its fully qualified service name (for health and reflection)."""
        register(servicer, self._server)
        self._service_names.append(full_name)

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` when the server starts draining (before in-flight calls are waited for)."""
        self._drain_hooks.append(hook)

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        names = [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self._server)
        self.port = self._server.add_insecure_port(f"{self.options.host}:{self.options.port}")
        if self.port == 0:
            raise RuntimeError(f"{self.name}: could not bind {self.options.host}:{self.options.port}")
        await self.set_serving(False)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._server.start()
        if self.options.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.options.metrics_port, addr=self.options.host)
        log.info("listening", extra={"address": self.address, "services": self._service_names,
                                     "metrics_port": self.options.metrics_port})

    async def set_serving(self, serving: bool, names: Iterable[str] | None = None) -> None:
        """Flip health for the given service names (default: all, plus the server-wide "")."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names if names is not None else ["", *self._service_names]:
            await self.health.set(name, status)

    async def drain(self) -> None:
        """NOT_SERVING everywhere, run drain hooks, let in-flight calls finish for ``grace_seconds``, stop."""
        if self._stopped.is_set():
            return
        log.info("draining", extra={"grace_seconds": self.options.grace_seconds})
        await self.set_serving(False)
        for hook in self._drain_hooks:
            try:
                await hook()
            except Exception:  # noqa: BLE001 - a failing hook must not block shutdown
                log.exception("drain hook failed")
        await self._server.stop(self.options.grace_seconds)
        self._stopped.set()
        log.info("stopped")

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start a graceful drain."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain()))

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

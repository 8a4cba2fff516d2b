"""Tracing and metrics shared by every service.

Tracing: OpenTelemetry spans per RPC, the W3C ``traceparent`` carried in gRPC metadata on every call of a channel
made with ``embedmesh.core.server.mesh_channel`` (put into each call by ``core.call_metadata``, or by
``TracingClientInterceptor`` on the plain path) and picked up by the server's handler wrapping, so one request is
one trace across gateway → preprocessor → cache → router → worker.
Export: OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; one compact JSON line per span on stderr when asked
(``EMBEDMESH_TRACE_CONSOLE=1``: logs are quiet by default, and four lines per request cost 15-50 % of a tiny
request's throughput); ``EMBEDMESH_TRACE_FILE`` appends the same lines to a file (tests use it to check a whole
trace). With none of them, spans are not even recorded.

Metrics: Prometheus counters and histograms per RPC and status code, served on the service's metrics port.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import prometheus_client
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

__all__ = [
    "CachedCounter",
    "CachedGauge",
    "CachedHistogram",
    "setup_tracing",
    "tracer",
    "extract_context",
    "inject_metadata",
    "TracingClientInterceptor",
    "RPC_REQUESTS",
    "RPC_LATENCY",
    "RPC_IN_FLIGHT",
]


class _KeptChildren:
    """``labels()`` answered from the children already made, by the values as passed: prometheus_client's own
    checks the count, converts each value to ``str`` and takes a lock on every call (~0.9 us, and a request makes
    three per RPC served plus the preprocessor's own, 1-2 % of its CPU in the front door's profile). The values
    name the same child either way; ``remove``/``clear`` forget every kept one."""

    _kept: dict[tuple[Any, ...], Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kept = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **named: Any) -> Any:
        try:
            child = self._kept.get(values) if not named else None
        except TypeError:  # an unhashable value: prometheus_client converts it to str
            return super().labels(*values, **named)  # type: ignore[misc]
        if child is None:
            child = super().labels(*values, **named)  # type: ignore[misc]
            if not named:
                self._kept[values] = child
        return child

    def remove(self, *values: Any) -> None:
        self._kept = {}
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._kept = {}
        super().clear()  # type: ignore[misc]


class CachedCounter(_KeptChildren, prometheus_client.Counter):
    """A ``prometheus_client.Counter`` whose labelled children are kept (``_KeptChildren``)."""


class CachedGauge(_KeptChildren, prometheus_client.Gauge):
    """A ``prometheus_client.Gauge`` whose labelled children are kept (``_KeptChildren``)."""


class CachedHistogram(_KeptChildren, prometheus_client.Histogram):
    """A ``prometheus_client.Histogram`` whose labelled children are kept (``_KeptChildren``)."""


RPC_REQUESTS = CachedCounter(
    "embedmesh_rpc_requests_total", "RPCs served, by service, method and status code", ["service", "method", "code"]
)
RPC_IN_FLIGHT = CachedGauge(
    "embedmesh_rpc_in_flight", "RPCs being served now, by service and method", ["service", "method"]
)
RPC_LATENCY = CachedHistogram(
    "embedmesh_rpc_duration_seconds", "RPC handling time (whole stream for streaming RPCs)", ["service", "method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)

_service = "embedmesh"


class _JsonLineExporter(SpanExporter):
    """One JSON object per span, for people (stderr) and for tests (a file)."""

    def __init__(self, stream: Any | None = None, path: str | None = None) -> None:
        self._stream = stream
        self._path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            parent = s.parent.span_id if s.parent else None
            lines.append(json.dumps({
                "span": s.name,
                "service": s.resource.attributes.get("service.name"),
                "trace_id": f"{ctx.trace_id:032x}",
                "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{parent:016x}" if parent else None,
                "ms": round(((s.end_time or 0) - (s.start_time or 0)) / 1e6, 3),
                "status": s.status.status_code.name,
                **{k: v for k, v in (s.attributes or {}).items() if isinstance(v, str | int | float | bool)},
            }))
        text = "".join(line + "\n" for line in lines)
        if self._stream is not None:
            self._stream.write(text)
            self._stream.flush()
        if self._path:
            with open(self._path, "a") as f:
                f.write(text)
        return SpanExportResult.SUCCESS


def setup_tracing(service: str) -> None:
    """Install the tracer provider for this process (call once, at start)."""
    global _service
    _service = service
    if os.environ.get("EMBEDMESH_TRACING", "on").lower() in ("0", "off", "false"):
        return
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    console = os.environ.get("EMBEDMESH_TRACE_CONSOLE", "0").lower() in ("1", "on", "true", "yes")
    path = os.environ.get("EMBEDMESH_TRACE_FILE")
    if not (endpoint or console or path):
        # Nobody reads spans: keep OpenTelemetry's no-op tracer, so a span costs nothing. A caller's trace context
        # still passes through (the no-op span carries its parent's ids to the next hop).
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"embedmesh-{service}"}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    elif console:
        provider.add_span_processor(BatchSpanProcessor(_JsonLineExporter(stream=sys.stderr)))
    if path:
        provider.add_span_processor(SimpleSpanProcessor(_JsonLineExporter(path=path)))
    trace.set_tracer_provider(provider)


def service_name() -> str:
    return _service


_tracer: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    """The process's tracer (looked up once: ``get_tracer`` costs more than a span)."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer("embedmesh")
    return _tracer


MAX_TRACE_VALUE = 8192
"""Longest trace-context value read (gRPC's own metadata limit): a frame of a multiplexed stream carries its trace
context in the message, where nothing else bounds it."""


def extract_context(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context:
    """The caller's trace context from gRPC invocation metadata or a stream frame's ``trace_context`` (empty context
    when none; values past ``MAX_TRACE_VALUE`` characters are ignored)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str) and len(v) <= MAX_TRACE_VALUE}
    return propagate.extract(carrier)


def inject_metadata(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """Outgoing metadata plus ``traceparent``/``tracestate`` for the current span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    out = list(metadata or ())
    out.extend(carrier.items())
    return out


def _with_trace(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, inject_metadata(details.metadata), details.credentials,
        details.wait_for_ready,
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_trace(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_trace(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_trace(details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_trace(details), request_iterator)


def TracingClientInterceptor() -> list[grpc.aio.ClientInterceptor]:  # noqa: N802 - reads like a class at call sites
    """Interceptors that put the current trace context on every outgoing call (``core.call_metadata``'s plain
    path; its fast path calls ``inject_metadata`` itself)."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]

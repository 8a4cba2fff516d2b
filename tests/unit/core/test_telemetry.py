"""core.telemetry: spans are written as one JSON line each (service, trace and parent ids, status, attributes), the
trace context travels in gRPC metadata (``inject_metadata`` → ``extract_context``), and the client interceptors
add it to every kind of outgoing call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from embedmesh.core import telemetry


def _provider(path: Path) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "embedmesh-test"}))
    provider.add_span_processor(SimpleSpanProcessor(telemetry._JsonLineExporter(path=str(path))))
    return provider


def test_spans_become_json_lines_linked_by_trace_and_parent(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    tracer = _provider(out).get_tracer("t")
    with tracer.start_as_current_span("outer") as outer:
        outer.set_attribute("model", "m1")
        with tracer.start_as_current_span("inner") as inner:
            inner.set_attribute("tokens", 12)
            inner.set_attribute("ratio", 0.5)
            inner.set_attribute("cached", True)
            inner.set_attribute("ids", [1, 2])  # a list is not a scalar: left out
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["span"] for x in lines] == ["inner", "outer"]  # a span is written when it ends
    inner_line, outer_line = lines
    assert {x["service"] for x in lines} == {"embedmesh-test"}
    assert inner_line["trace_id"] == outer_line["trace_id"] == f"{outer.get_span_context().trace_id:032x}"
    assert outer_line["parent_id"] is None and inner_line["parent_id"] == outer_line["span_id"]
    assert len(inner_line["span_id"]) == 16 and inner_line["status"] == "UNSET"
    assert (inner_line["tokens"], inner_line["ratio"], inner_line["cached"]) == (12, 0.5, True)
    assert "ids" not in inner_line and outer_line["model"] == "m1"
    assert inner_line["ms"] >= 0


def test_exporter_writes_to_a_stream_too(tmp_path: Path) -> None:
    class Sink:
        def __init__(self) -> None:
            self.text, self.flushed = "", 0

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            self.flushed += 1

    sink = Sink()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(telemetry._JsonLineExporter(stream=sink)))
    with provider.get_tracer("t").start_as_current_span("one"):
        pass
    assert json.loads(sink.text)["span"] == "one" and sink.flushed == 1


def test_trace_context_travels_in_metadata(tmp_path: Path) -> None:
    tracer = _provider(tmp_path / "t.jsonl").get_tracer("t")
    with tracer.start_as_current_span("client") as span:
        md = telemetry.inject_metadata([("x-other", "1")])
    ctx = span.get_span_context()
    assert md[0] == ("x-other", "1")
    traceparent = dict(md)["traceparent"]
    assert traceparent.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")  # then the flags (sampled)
    remote = trace.get_current_span(telemetry.extract_context(md)).get_span_context()
    assert (remote.trace_id, remote.span_id, remote.is_remote) == (ctx.trace_id, ctx.span_id, True)
    # No context in, no span out; binary metadata values are skipped.
    empty = trace.get_current_span(telemetry.extract_context([("x-bin", b"\x00")])).get_span_context()
    assert not empty.is_valid
    assert not trace.get_current_span(telemetry.extract_context(None)).get_span_context().is_valid


def test_outside_a_span_nothing_is_added() -> None:
    assert telemetry.inject_metadata(None) == []
    assert telemetry.inject_metadata([("a", "b")]) == [("a", "b")]


async def test_client_interceptors_add_traceparent_to_every_call_kind(tmp_path: Path) -> None:
    interceptors = telemetry.TracingClientInterceptor()
    assert [type(i).__mro__[1] for i in interceptors] == [
        grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
        grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor]
    seen: list[Any] = []

    async def continuation(details: Any, request: Any) -> str:
        seen.append((details, request))
        return "called"

    details = grpc.aio.ClientCallDetails("/svc/M", 5.0, [("k", "v")], None, True)
    tracer = _provider(tmp_path / "t.jsonl").get_tracer("t")
    with tracer.start_as_current_span("call") as span:
        results = [
            await interceptors[0].intercept_unary_unary(continuation, details, "req"),
            await interceptors[1].intercept_unary_stream(continuation, details, "req"),
            await interceptors[2].intercept_stream_unary(continuation, details, "req"),
            await interceptors[3].intercept_stream_stream(continuation, details, "req"),
        ]
    assert results == ["called"] * 4
    want = f"00-{span.get_span_context().trace_id:032x}-{span.get_span_context().span_id:016x}-"
    for sent, request in seen:
        assert request == "req"
        assert (sent.method, sent.timeout, sent.wait_for_ready) == ("/svc/M", 5.0, True)
        assert sent.metadata[0] == ("k", "v") and dict(sent.metadata)["traceparent"].startswith(want)


def test_rpc_metrics_are_labelled_by_service_method_and_code() -> None:
    before = telemetry.RPC_REQUESTS.labels("t-svc", "M", "OK")._value.get()
    telemetry.RPC_REQUESTS.labels(service="t-svc", method="M", code="OK").inc()
    assert telemetry.RPC_REQUESTS.labels("t-svc", "M", "OK")._value.get() == before + 1
    assert telemetry.RPC_LATENCY._labelnames == ("service", "method")


_PROBE = """
import sys
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from embedmesh.core import telemetry
telemetry.setup_tracing("probe")
sdk = isinstance(trace.get_tracer_provider(), TracerProvider)
# A caller's context passes through a span of this process whether or not spans are recorded.
parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
with telemetry.tracer().start_as_current_span("s", context=propagate.extract(parent)):
    out = {}
    propagate.inject(out)
print(sdk, out.get("traceparent", "")[:35])
"""


@pytest.mark.parametrize(("env", "records"), [
    ({}, False),  # quiet by default: no line per request on stderr unless asked
    ({"EMBEDMESH_TRACE_CONSOLE": "0"}, False),
    ({"EMBEDMESH_TRACE_CONSOLE": "1"}, True),
    ({"EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_TRACE_FILE": "{tmp}/spans.jsonl"}, True),
], ids=["default", "nothing exports", "console", "file"])
def test_spans_are_recorded_only_when_something_exports_them(tmp_path: Path, env: dict[str, str],
                                                              records: bool) -> None:
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("EMBEDMESH_TRACE", "OTEL_")) and k != "EMBEDMESH_TRACING"}
    clean.update({k: v.format(tmp=tmp_path) for k, v in env.items()})
    out = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    sdk, traceparent = out.stdout.split()
    assert sdk == str(records)
    assert traceparent == "00-0af7651916cd43dd8448eb211c80319c"  # the caller's trace id goes on either way


def test_an_oversized_trace_context_value_is_ignored() -> None:
    from opentelemetry import trace as otel_trace

    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = telemetry.extract_context([("traceparent", good)])
    assert otel_trace.get_current_span(ctx).get_span_context().trace_id == 0x0af7651916cd43dd8448eb211c80319c
    # A later version may carry more fields: valid at any length, were it not for the cap.
    later = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-"
    short = telemetry.extract_context([("traceparent", later + "x" * 16)])
    assert otel_trace.get_current_span(short).get_span_context().is_valid
    huge = telemetry.extract_context([("traceparent", later + "x" * telemetry.MAX_TRACE_VALUE)])
    assert not otel_trace.get_current_span(huge).get_span_context().is_valid


@pytest.mark.parametrize("kind", ["counter", "gauge", "histogram"])
def test_cached_metrics_keep_their_children_and_export_what_prometheus_client_exports(kind: str) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    plain_type, cached_type = {"counter": (Counter, telemetry.CachedCounter),
                               "gauge": (Gauge, telemetry.CachedGauge),
                               "histogram": (Histogram, telemetry.CachedHistogram)}[kind]
    exported = []
    for metric_type in (plain_type, cached_type):
        registry = CollectorRegistry()
        metric = metric_type("t_metric", "doc", ["model", "code"], registry=registry)
        for model, code in [("a", "OK"), ("b", "OK"), ("a", "OK"), ("a", "NOT_FOUND")]:
            child = metric.labels(model, code)
            child.observe(2) if kind == "histogram" else child.inc(2)
        child = metric.labels(model="b", code="OK")
        child.observe(1) if kind == "histogram" else child.inc(1)
        assert metric.labels("a", "OK") is metric.labels(model="a", code="OK")
        exported.append([(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples
                         if not s.name.endswith("_created")])
    assert exported[0] == exported[1]  # the same series and values as prometheus_client's own metric
    assert len(exported[0]) >= 3


def test_a_removed_or_cleared_child_is_not_kept() -> None:
    from prometheus_client import CollectorRegistry

    metric = telemetry.CachedCounter("t_kept", "doc", ["model"], registry=CollectorRegistry())
    first = metric.labels("a")
    first.inc()
    assert metric.labels("a") is first
    metric.remove("a")
    second = metric.labels("a")
    assert second is not first and second._value.get() == 0
    metric.clear()
    assert metric.labels("a") is not second
    with pytest.raises(ValueError):
        metric.labels("a", "b")  # prometheus_client's own checks still run for values not seen before

"""The gateway's Prometheus metrics, served on ``GET /metrics`` (the process-wide default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["REQUESTS", "LATENCY", "INFLIGHT", "DISCONNECTS"]

REQUESTS = Counter("embedmesh_gateway_requests_total", "HTTP requests by route and status", ["route", "status"])
LATENCY = Histogram(
    "embedmesh_gateway_request_duration_seconds",
    "Time to the response head by route (the whole body for non-streamed responses)",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
INFLIGHT = Gauge("embedmesh_gateway_inflight_requests", "Requests being handled (a stream until its last byte)")
DISCONNECTS = Counter("embedmesh_gateway_stream_disconnects_total",
                      "Streams the client left before the end (their gRPC calls were cancelled)")

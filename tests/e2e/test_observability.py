"""One request is one trace across every hop; metrics endpoints expose the documented names."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e


def spans_of(path: str, trace_id: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [s for s in (json.loads(line) for line in f if line.strip()) if s["trace_id"] == trace_id]


def test_one_trace_covers_every_hop(mesh: Any) -> None:
    trace_id = secrets.token_hex(16)
    parent = secrets.token_hex(8)
    r = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                   json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3})
    assert r.status_code == 200
    # The router is a hop of its own only as a process (not inside the preprocessor, the one-replica default).
    hops = {"embedmesh-gateway", "embedmesh-preprocessor", "embedmesh-worker",
            *(["embedmesh-router"] if mesh.extra["router"] != mesh.preprocessor else [])}
    deadline = time.monotonic() + 10
    spans: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        spans = spans_of(mesh.extra["trace_file"], trace_id)
        if hops <= {s["service"] for s in spans}:
            break
        time.sleep(0.2)
    services = {s["service"] for s in spans}
    assert hops <= services
    by_id = {s["span_id"]: s for s in spans}
    gateway = next(s for s in spans if s["service"] == "embedmesh-gateway")
    assert gateway["parent_id"] == parent
    worker = next(s for s in spans if s["service"] == "embedmesh-worker")
    assert by_id[worker["parent_id"]]["service"] == "embedmesh-preprocessor"
    pre = by_id[worker["parent_id"]]
    assert by_id[pre["parent_id"]]["service"] == "embedmesh-gateway"


def test_metrics_endpoints(mesh: Any) -> None:
    httpx.post(f"{mesh.base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    gateway = httpx.get(f"{mesh.base_url}/metrics", timeout=10).text
    assert 'embedmesh_gateway_requests_total{route="/v1/completions",status="200"}' in gateway
    base = mesh.extra["metrics_base"]
    pre = urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/metrics", timeout=10).read().decode()
    assert 'embedmesh_rpc_requests_total{code="OK",method="GenerateInline",service="preprocessor"}' in pre
    assert 'embedmesh_preprocessor_generate_total{stream="false",task="completion",transport="message"}' in pre
    assert "embedmesh_time_to_first_token_seconds_bucket" in pre
    worker = urllib.request.urlopen(f"http://127.0.0.1:{base + 10}/metrics", timeout=10).read().decode()
    assert "embedmesh_worker_generated_tokens_total" in worker
    inside = mesh.extra["router"] == mesh.preprocessor  # the router's metrics are then the preprocessor's
    router = urllib.request.urlopen(f"http://127.0.0.1:{base + (1 if inside else 2)}/metrics",
                                    timeout=10).read().decode()
    assert "embedmesh_router_decisions_total" in router

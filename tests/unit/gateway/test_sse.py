"""Client disconnect: the gRPC call to the preprocessor is cancelled promptly — mid-stream, before the first token,
and during a non-streamed completion — and the gateway goes on serving."""

from __future__ import annotations

import re
import time

import httpx

from tests.unit.gateway.conftest import MODEL, Harness, delta, wait_for

BODY = {"model": MODEL, "prompt": "Write a very long story", "max_tokens": 100000, "stream": True}


def metric(gw: Harness, name: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_stream_cancels_the_grpc_call(gw: Harness) -> None:
    gw.fake.script.stream = [delta(0, "Once")]
    gw.fake.script.hang_after = True  # generates forever: only a cancel ends it
    before = metric(gw, "embedmesh_gateway_stream_disconnects_total")
    with httpx.Client(timeout=10) as http, http.stream("POST", f"{gw.url}/v1/completions", json=BODY) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert not gw.fake.cancelled.is_set()
                t0 = time.monotonic()
                break  # leaving iter_lines early closes the connection (httpcore drops it)
    assert gw.fake.cancelled.wait(5), "the preprocessor's StreamComplete was not cancelled"
    assert time.monotonic() - t0 < 3
    assert wait_for(lambda: metric(gw, "embedmesh_gateway_stream_disconnects_total") == before + 1)
    assert wait_for(lambda: metric(gw, "embedmesh_gateway_inflight_requests") <= 1)  # only /metrics itself
    gw.fake.reset()
    ok = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=10)
    assert ok.status_code == 200


def test_disconnect_before_the_first_token_cancels_the_grpc_call(gw: Harness) -> None:
    gw.fake.script.hang_before_first = True  # a long prefill: the response has not started yet
    try:
        httpx.post(f"{gw.url}/v1/completions", json=BODY, timeout=0.5)
    except httpx.TimeoutException:
        pass
    assert gw.fake.cancelled.wait(5), "the preprocessor's StreamComplete was not cancelled"


def test_disconnect_during_a_non_streamed_completion_cancels_the_grpc_call(gw: Harness) -> None:
    gw.fake.script.hang_before_first = True
    try:
        httpx.post(f"{gw.url}/v1/completions", json={**BODY, "stream": False}, timeout=0.5)
    except httpx.TimeoutException:
        pass
    assert gw.fake.cancelled.wait(5), "the preprocessor's Complete was not cancelled"
    gw.fake.reset()
    assert httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=10).status_code == 200


def test_stream_that_ends_normally_is_not_a_disconnect(gw: Harness) -> None:
    before = metric(gw, "embedmesh_gateway_stream_disconnects_total")
    r = httpx.post(f"{gw.url}/v1/completions", json={**BODY, "max_tokens": 4}, timeout=10)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert metric(gw, "embedmesh_gateway_stream_disconnects_total") == before
    assert not gw.fake.cancelled.is_set()

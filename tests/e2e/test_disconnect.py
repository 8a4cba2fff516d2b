"""A client that goes away mid-stream stops generation on the worker."""

from __future__ import annotations

import time
from typing import Any

import grpc
import httpx
import pytest

from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e


def stats(addr: str) -> worker_pb2.GetStatsResponse:
    with grpc.insecure_channel(addr) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def test_disconnect_mid_stream_aborts_generation(mesh: Any) -> None:
    worker = mesh.workers[0]
    before = stats(worker)
    max_tokens = 2000  # minutes of work at this model's speed: it must be stopped, not finished
    payload = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": max_tokens,
               "stream": True, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    received = 0
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{mesh.base_url}/v1/completions", json=payload) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    received += 1
                    if received >= 3:
                        break
    # The connection is closed here. The worker must abort that sequence promptly.
    deadline = time.monotonic() + 30
    after = stats(worker)
    while time.monotonic() < deadline and not (after.aborted_requests > before.aborted_requests
                                               and after.active_requests == 0):
        time.sleep(0.2)
        after = stats(worker)
    assert after.aborted_requests == before.aborted_requests + 1
    assert after.active_requests == 0
    generated = after.generated_tokens - before.generated_tokens
    assert received >= 3
    assert generated < max_tokens // 4, f"{generated} tokens generated after the client left"
    # And the mesh still serves.
    ok = httpx.post(f"{mesh.base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200

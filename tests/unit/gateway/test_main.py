"""``python -m embedmesh.gateway.main``: announces its address, serves, stops cleanly on SIGTERM/SIGINT, and drains:
open SSE streams finish (bounded by ``--drain-seconds``) while new connections are refused."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.auth import Access
from embedmesh.core.server import Server, ServerOptions
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_main_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.gateway.main", "--port", "0", "--preprocessor",
                             "127.0.0.1:1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"EMBEDMESH_TRACE_CONSOLE": "0", "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"gateway listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert m, line
        r = httpx.get(f"{m.group(1)}/health", timeout=10)
        assert r.status_code == 503  # nothing listens at the preprocessor address
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    logs = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert logs and all(x["service"] == "gateway" for x in logs)
    assert logs[-1]["msg"] == "stopped"
    assert "Traceback" not in err


class _SlowStream(inference_pb2_grpc.InferenceServiceServicer):
    """A preprocessor whose streams send ``DELTAS`` deltas ``GAP_S`` apart, then finish and report usage (longer than
    the 5 s uvicorn grace the gateway used to have)."""

    DELTAS = 30
    GAP_S = 0.2

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def Generate(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        def event(**fields: Any) -> inference_pb2.GenerateResponse:
            return inference_pb2.GenerateResponse(completion_chunk=inference_pb2.StreamCompleteResponse(
                id="cmpl-drain", model="m", **fields))

        try:
            for i in range(self.DELTAS):
                yield event(index=0, text=f"t{i} ")
                self.started.set()
                await asyncio.sleep(self.GAP_S)
            yield event(index=0, finish_reason=common_pb2.FINISH_REASON_LENGTH)
            yield event(usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=self.DELTAS,
                                               total_tokens=self.DELTAS + 1))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def GenerateInline(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        async for event in self.Generate(None, context):
            yield event


@pytest.fixture
def slow_preprocessor() -> Iterator[tuple[str, _SlowStream]]:
    fake = _SlowStream()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    async def start() -> Server:
        server = Server("slow-preprocessor", ServerOptions(port=0, grace_seconds=0.5))
        server.add(inference_pb2_grpc.add_InferenceServiceServicer_to_server, fake,
                   "embedmesh.inference.v1.InferenceService", access=Access.OPEN)
        await server.start()
        await server.set_serving(True)
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield server.address, fake
    asyncio.run_coroutine_threadsafe(server.drain(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _start_gateway(preprocessor: str, drain_seconds: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.gateway.main", "--port", "0", "--preprocessor",
                             preprocessor, "--drain-seconds", str(drain_seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"EMBEDMESH_TRACE_CONSOLE": "0", "PATH": "/usr/bin:/bin"})
    assert proc.stdout is not None
    m = re.fullmatch(r"gateway listening on (http://127\.0\.0\.1:\d+)\n", proc.stdout.readline())
    assert m
    return proc, m.group(1)


def _stream_events(url: str, fake: _SlowStream, proc: subprocess.Popen[str]) -> tuple[list[str], bool]:
    """Open one SSE completion, SIGTERM the gateway once the first delta arrived; (data lines, port refused new
    connections while the stream was still open)."""
    lines: list[str] = []
    refused_during_stream = False
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if len(lines) == 1:
                proc.send_signal(signal.SIGTERM)
            elif not refused_during_stream and len(lines) < _SlowStream.DELTAS:
                try:
                    httpx.get(f"{url}/health", timeout=2)
                except httpx.ConnectError:
                    refused_during_stream = True
    return lines, refused_during_stream


def test_sigterm_lets_open_streams_finish_and_refuses_new_connections(
        slow_preprocessor: tuple[str, _SlowStream]) -> None:
    address, fake = slow_preprocessor
    proc, url = _start_gateway(address, drain_seconds=30)
    try:
        lines, refused = _stream_events(url, fake, proc)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(x) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(f"t{i} " for i in range(_SlowStream.DELTAS))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert refused, "the gateway kept accepting connections while draining"
    assert not fake.cancelled.is_set()
    assert proc.returncode == 0, err
    assert [json.loads(x) for x in err.splitlines() if x.startswith("{")][-1]["msg"] == "stopped"


def test_a_drain_of_zero_seconds_cuts_open_streams(slow_preprocessor: tuple[str, _SlowStream]) -> None:
    """The contrast that shows the drain is what lets streams finish: with no drain time the stream is cut and its
    gRPC call cancelled."""
    address, fake = slow_preprocessor
    proc, url = _start_gateway(address, drain_seconds=0)
    try:
        try:
            lines, _ = _stream_events(url, fake, proc)
        except httpx.HTTPError:
            lines = []
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Cut before its end: the last events are the shutdown's retry error and [DONE], not the stream's own end.
    assert len(lines) < _SlowStream.DELTAS
    assert lines[-1] == "[DONE]" and '"code":"server_shutting_down"' in lines[-2]
    assert fake.cancelled.wait(10)
    assert proc.returncode == 0

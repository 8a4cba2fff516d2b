"""The front door drains like the workers do, and what it cannot finish it ends cleanly: SIGTERM to the gateway
with two long streams in flight (the mocker engine, 50 ms a token, 400 tokens: ~20 s) and a 1 s drain grace.
Each stream ends at the grace with an SSE error event that tells the client to retry (``server_shutting_down``,
status 503) and ``[DONE]``, not with a bare transport error; the official SDK raises an ``APIError`` carrying that
message, not a connection error; a Responses stream ends with its own shape (``error``, then ``response.failed``,
numbered on); new connections are refused from the signal on."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.load import child_pid
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

BODY = {"model": "mocker", "prompt": "a stream longer than the drain grace", "max_tokens": 400, "stream": True}


@pytest.fixture()
def mesh() -> Iterator[Mesh]:
    m = start_mesh(workers=1, engine="mocker", env={"EMBEDMESH_WORKER_MOCKER_DECODE_MS": "50",
                                                    "EMBEDMESH_DRAIN_GRACE_SECONDS": "1"})
    yield m
    m.stop()


def _raw_stream(base_url: str, started: threading.Event, out: dict[str, object]) -> None:
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=BODY, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except Exception as e:  # noqa: BLE001 - the test asserts there is none
        out["error"] = repr(e)
    out["events"] = events
    started.set()


def _sdk_stream(base_url: str, started: threading.Event, out: dict[str, object]) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    texts: list[str] = []
    try:
        for chunk in client.completions.create(**{k: v for k, v in BODY.items() if k != "stream"}, stream=True):
            texts.extend(c.text for c in chunk.choices)
            started.set()
    except Exception as e:  # noqa: BLE001 - the test looks at which
        out["error"] = e
    out["texts"] = texts
    started.set()


def _responses_stream(base_url: str, started: threading.Event, out: dict[str, object]) -> None:
    events: list[dict[str, object]] = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/responses", timeout=60, json={
                "model": "mocker", "input": BODY["prompt"], "max_output_tokens": 400, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.output_text.delta":
                        started.set()
    except Exception as e:  # noqa: BLE001 - the test asserts there is none
        out["error"] = repr(e)
    out["events"] = events
    started.set()


def test_sigterm_ends_open_streams_with_a_retry_event_at_the_grace(mesh: Mesh) -> None:
    raw, sdk, resp = {}, {}, {}  # type: ignore[var-annotated]
    raw_started, sdk_started, resp_started = threading.Event(), threading.Event(), threading.Event()
    threads = [threading.Thread(target=_raw_stream, args=(mesh.base_url, raw_started, raw)),
               threading.Thread(target=_sdk_stream, args=(mesh.base_url, sdk_started, sdk)),
               threading.Thread(target=_responses_stream, args=(mesh.base_url, resp_started, resp))]
    for t in threads:
        t.start()
    assert raw_started.wait(60) and sdk_started.wait(60) and resp_started.wait(60), "the streams never started"
    os.kill(child_pid(mesh, "gateway"), signal.SIGTERM)
    t0 = time.monotonic()
    time.sleep(0.5)
    host, port = mesh.base_url.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(OSError):  # the listener closed at the signal
        socket.create_connection((host, int(port)), timeout=2).close()
    for t in threads:
        t.join(30)
    took = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads)

    assert raw["status"] == 200 and "error" not in raw, raw.get("error")
    events = raw["events"]
    assert isinstance(events, list) and len(events) >= 3
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "server_shutting_down" and "retry" in last["error"]["message"]
    tokens = [json.loads(e) for e in events[:-2]]
    assert all("choices" in t for t in tokens)
    assert 0 < sum(len(t["choices"][0]["text"]) > 0 for t in tokens) < 400  # cut before the end, after tokens

    err = sdk["error"]
    assert isinstance(err, openai.APIError) and not isinstance(err, openai.APIConnectionError), repr(err)
    assert "retry" in str(err) and sdk["texts"]
    assert "error" not in resp, resp.get("error")
    revents = resp["events"]
    assert isinstance(revents, list)
    assert [e["type"] for e in revents[-2:]] == ["error", "response.failed"]
    assert revents[-2]["code"] == "server_shutting_down" and "retry" in str(revents[-2]["message"])
    failed = revents[-1]["response"]
    assert isinstance(failed, dict) and failed["status"] == "failed" and failed["output"]  # the text so far
    assert [e["sequence_number"] for e in revents] == list(range(len(revents)))
    assert took < 20, "the streams ran to their end instead of being cut at the grace"

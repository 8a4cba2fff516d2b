"""Helpers for e2e tests that kill or drain parts of a running mesh: per-worker stats, process ids, the
preprocessor's counters, and streamed completions whose every outcome is recorded."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
import httpx

from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.mesh import Mesh

__all__ = ["Outcome", "stats", "child_pid", "metric", "stream_completion", "Load"]


def stats(addr: str) -> worker_pb2.GetStatsResponse:
    with grpc.insecure_channel(addr) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def child_pid(mesh: Mesh, name: str) -> int:
    """The pid the launcher printed for its child ``name`` (``worker-0``, ``preprocessor``, ...)."""
    m = re.search(rf"\[launcher\]\s+{re.escape(name)}\s+\S+\s+\(pid (\d+)\)", mesh.log_tail(1_000_000))
    assert m, f"no pid for {name} in the launcher's log"
    return int(m.group(1))


def metric(mesh: Mesh, name: str, port_offset: int = 1) -> float:
    """Sum of every sample of ``name`` on a service's /metrics (default: the preprocessor's)."""
    url = f"http://127.0.0.1:{int(str(mesh.extra['metrics_base'])) + port_offset}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@dataclass
class Outcome:
    """What one streamed completion ended with."""

    kind: str
    """"ok" (every choice finished, then [DONE]), "http_error" (an error status before the stream started),
    "sse_error" (an error event in the stream), or "broken" (anything else: a cut connection, no [DONE])."""
    started: float
    ended: float
    status: int = 200
    retry_after: str | None = None
    error: dict[str, object] = field(default_factory=dict)
    finish_reason: str | None = None
    text: str = ""


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int, *,
                      first_token: threading.Event | None = None) -> Outcome:
    t0 = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                return Outcome("http_error", t0, time.monotonic(), r.status_code, r.headers.get("retry-after"),
                               r.json().get("error", {}))
            finish = None
            text = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    kind = "ok" if finish else "broken"
                    return Outcome(kind, t0, time.monotonic(), finish_reason=finish, text="".join(text))
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome("sse_error", t0, time.monotonic(), error=chunk["error"])
                for c in chunk["choices"]:
                    text.append(c["text"])
                    finish = c["finish_reason"] or finish
                if first_token is not None:
                    first_token.set()
    except httpx.HTTPError as e:
        return Outcome("broken", t0, time.monotonic(), error={"message": repr(e)})
    return Outcome("broken", t0, time.monotonic(), error={"message": "the stream ended without [DONE]"})


def retryable(o: Outcome) -> bool:
    """A failure a client can act on: 503 + Retry-After, or an SSE error event saying the service is unavailable."""
    if o.kind == "http_error":
        return o.status == 503 and o.retry_after is not None and int(o.retry_after) >= 1
    if o.kind == "sse_error":
        return o.error.get("type") == "service_unavailable"
    return False


class Load:
    """``clients`` threads, each sending streamed completions one after another until ``stop``."""

    def __init__(self, base_url: str, model: str, clients: int, max_tokens: int) -> None:
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._streaming: dict[int, threading.Event] = {}  # client -> its request in flight got its first token
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(base_url, model, i, max_tokens), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, base_url: str, model: str, i: int, max_tokens: int) -> None:
        n = 0
        while not self._stop.is_set():
            first = threading.Event()
            with self._lock:
                self._streaming[i] = first
            o = stream_completion(base_url, model, f"Client {i} request {n}: tell me about rivers.", max_tokens,
                                  first_token=first)
            with self._lock:
                del self._streaming[i]
                self.outcomes.append(o)
            n += 1

    def all_streaming(self) -> bool:
        """Every request in flight has received a token (none is waiting for its first: a worker lost now cuts
        streams, it cannot retry them elsewhere)."""
        with self._lock:
            return bool(self._streaming) and all(e.is_set() for e in self._streaming.values())

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(600)
        return list(self.outcomes)

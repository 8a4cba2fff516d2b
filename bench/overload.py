"""Overload: offer 4x the mesh's measured capacity and compare admission control as configured with it turned off.

1. capacity: closed-loop clients at rising concurrency against a real mesh (echo engine: no model, so what is
   measured is the mesh itself); capacity = the best requests/s among the levels whose p99 stays under
   ``--p99-bound-ms``.
2. an open-loop load generator (asyncio, fixed arrival rate, ``--connections`` keep-alive HTTP/1.1 connections;
   latency counted from each request's scheduled arrival, so a slow server cannot slow the offered load down)
   offers ``--factor`` x capacity for ``--seconds``:
   (A) admission as configured: preprocessor ``--max-inflight`` (EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT), worker
       ``--max-queue`` (EMBEDMESH_WORKER_MAX_QUEUE), their defaults unless those variables are set;
   (B) the same with both set so large that nothing is ever refused (the baseline: no admission control).
Printed for each: offered and achieved arrival rate, admitted throughput, 429/503 refusals (and how fast they come
back), admitted p50/p99, timeouts/errors. A benchmark, not a test: nothing here asserts a time.

    python bench/overload.py [--seconds 60] [--factor 4] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import start_mesh  # noqa: E402

MODEL_ECHO = "echo"
UNLIMITED = str(10**9)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def configured_limits() -> tuple[int, int]:
    """The admission limits a mesh started from this environment runs with: (preprocessor max_inflight,
    worker max_queue)."""
    from embedmesh.services.preprocessor.config import PreprocessorConfig
    from embedmesh.services.worker.config import WorkerConfig

    return (int(os.environ.get("EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT", PreprocessorConfig.max_inflight)),
            int(os.environ.get("EMBEDMESH_WORKER_MAX_QUEUE", WorkerConfig.max_queue)))


@dataclass
class Outcome:
    ok: list[float] = field(default_factory=list)
    refused: dict[int, list[float]] = field(default_factory=dict)  # status -> seconds until the refusal came back
    errors: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    send_wall: float = 0.0
    unfinished: int = 0
    ok_wall: float = 0.0
    ok_service: list[float] = field(default_factory=list)
    """Admitted requests timed from the moment they were written (the mesh's own share, no wait for a connection)."""
    refused_service: list[float] = field(default_factory=list)
    """From the first scheduled arrival to the last admitted answer."""

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


class Conn:
    """One keep-alive HTTP/1.1 connection that sends one fixed request. httpx's pool slows down badly with
    thousands of requests pending (its bookkeeping grows with them), so the load generator would measure itself;
    this stays cheap per request at any backlog. Reconnects when the server closes."""

    def __init__(self, host: str, port: int, path: str, body: dict[str, Any]) -> None:
        import json

        self.host, self.port = host, port
        data = json.dumps(body).encode()
        self.request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self) -> int:
        """The response's status code (the body is read and dropped)."""
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        try:
            self.writer.write(self.request)
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if "content-length" in headers:
                await self.reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    await self.reader.readexactly(size + 2)
                    if size == 0:
                        break
            if headers.get("connection", "").lower() == "close":
                self.close()
            return status
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def capacity(conns: list[Conn], levels: list[int], probe_s: float,
                   bound_s: float) -> tuple[float, list[tuple[int, float, float, float]]]:
    """Closed loop at each concurrency for ``probe_s``: (capacity req/s, rows of (concurrency, req/s, p50, p99))."""
    rows = []
    for c in levels:
        lat: list[float] = []
        end = time.perf_counter() + probe_s

        async def client(conn: Conn, lat: list[float], end: float) -> None:
            while time.perf_counter() < end:
                t = time.perf_counter()
                if await conn.send() == 200:
                    lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*[client(conns[i], lat, end) for i in range(c)])
        wall = time.perf_counter() - t0
        rows.append((c, len(lat) / wall, pct(lat, 50), pct(lat, 99)))
    bounded = [r for r in rows if r[3] <= bound_s] or rows[:1]
    return max(r[1] for r in bounded), rows


async def open_loop(conns: list[Conn], rate: float, seconds: float, timeout: float, drain_s: float) -> Outcome:
    """Arrivals at ``rate`` requests/s on a fixed schedule for ``seconds``, whatever the answers, served by
    ``len(conns)`` connections; a request waiting for a free connection is still late from its scheduled time.
    Then wait up to ``drain_s`` for the stragglers."""
    out = Outcome()
    total = int(rate * seconds)
    arrivals: asyncio.Queue[float | None] = asyncio.Queue()
    t0 = time.perf_counter()

    async def sender(conn: Conn) -> None:
        while (scheduled := await arrivals.get()) is not None:
            if time.perf_counter() - scheduled > timeout:  # waited past the client's patience: gave up
                out.error("timeout")
                continue
            sent = time.perf_counter()
            try:
                status = await asyncio.wait_for(conn.send(), timeout)
            except TimeoutError:
                out.error("timeout")
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                out.error(type(e).__name__)
                continue
            now = time.perf_counter()
            took = now - scheduled
            if status == 200:
                out.ok.append(took)
                out.ok_service.append(now - sent)
                out.ok_wall = max(out.ok_wall, time.perf_counter() - t0)
            elif status in (429, 503):
                out.refused.setdefault(status, []).append(took)
                out.refused_service.append(now - sent)
            else:
                out.error(f"HTTP {status}")

    senders = [asyncio.create_task(sender(c)) for c in conns]
    i = 0
    while i < total:
        due = min(total, int((time.perf_counter() - t0) * rate) + 1)
        while i < due:
            arrivals.put_nowait(t0 + i / rate)
            i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
    out.sent, out.send_wall = i, time.perf_counter() - t0
    for _ in senders:
        arrivals.put_nowait(None)
    _, pending = await asyncio.wait(senders, timeout=drain_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    answered = len(out.ok) + sum(len(v) for v in out.refused.values()) + sum(out.errors.values())
    out.unfinished = out.sent - answered
    for c in conns:
        c.close()
    return out


async def run_mesh(label: str, env: dict[str, str], a: argparse.Namespace, body: dict[str, Any],
                   rate: float | None) -> tuple[Outcome, float]:
    """Start a mesh with ``env``; measure capacity when ``rate`` is None; offer ``rate`` (or factor x capacity)."""
    for attempt in range(3):
        try:
            mesh = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0", **env})
            break
        except RuntimeError as e:
            # start_mesh picks its metrics ports at random; after a run with a thousand client sockets one may be
            # taken, and the mesh exits at once. A fresh start picks others.
            if attempt == 2 or "exited early" not in str(e):
                raise
            print(f"(mesh did not start: {str(e).splitlines()[0]}; retrying)", flush=True)
    try:
        conns = [Conn("127.0.0.1", mesh.gateway_port, "/v1/completions", body) for _ in range(a.connections)]
        for _ in range(50):  # warm-up
            await conns[0].send()
        if rate is None:
            levels = [int(x) for x in a.levels.split(",")]
            cap, rows = await capacity(conns, levels, a.probe_seconds, a.p99_bound_ms / 1e3)
            print(f"\ncapacity (closed loop, {label}, {a.probe_seconds:.0f} s per level):")
            print(f"  {'clients':>8}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
            for c, rps, p50, p99 in rows:
                print(f"  {c:>8}{rps:>10.0f}{p50 * 1e3:>10.1f}{p99 * 1e3:>10.1f}")
            print(f"  capacity = {cap:.0f} req/s (best level with p99 <= {a.p99_bound_ms:.0f} ms)", flush=True)
            rate = a.factor * cap
        print(f"\noffering {rate:.0f} req/s for {a.seconds:.0f} s: {label} ...", flush=True)
        out = await open_loop(conns, rate, a.seconds, a.timeout, a.drain_seconds)
    finally:
        mesh.stop()
    return out, rate


def report(rate: float, seconds: float, results: list[tuple[str, Outcome]]) -> None:
    print(f"\noverload: {rate:.0f} req/s offered for {seconds:.0f} s (open loop)")
    print("  'from arrival': from the scheduled arrival (includes waiting for one of the client's connections);")
    print("  'in mesh': from the moment the request was written to the gateway until its answer.")
    print(f"  {'':<40}{'arrive/s':>9}{'admitted/s':>11}{'429':>7}{'503':>7}{'timeout/err':>12}{'unfinished':>11}")
    for label, o in results:
        print(f"  {label:<40}{o.sent / o.send_wall:>9.0f}{len(o.ok) / max(o.ok_wall, 1e-9):>11.0f}"
              f"{len(o.refused.get(429, [])):>7}{len(o.refused.get(503, [])):>7}{sum(o.errors.values()):>12}"
              f"{o.unfinished:>11}")
    print(f"\n  latency ms{'':<30}{'admitted p50':>13}{'p99':>9}{'refused p50':>13}{'p99':>9}")
    for label, o in results:
        refused = [x for v in o.refused.values() for x in v]
        for what, ok, ref in (("from arrival", o.ok, refused), ("in mesh", o.ok_service, o.refused_service)):
            print(f"  {label.split(' (')[0]:<26} {what:<13}{pct(ok, 50) * 1e3:>13.1f}{pct(ok, 99) * 1e3:>9.1f}"
                  f"{pct(ref, 50) * 1e3:>13.1f}{pct(ref, 99) * 1e3:>9.1f}")
    for label, o in results:
        if o.errors:
            print(f"  {label}: errors {', '.join(f'{k} x{v}' for k, v in sorted(o.errors.items()))}")


async def main_async(a: argparse.Namespace) -> None:
    inflight, queue = configured_limits()
    body = {"model": MODEL_ECHO, "prompt": [1, 2, 3], "max_tokens": a.max_tokens}
    print(f"overload: echo engine, prompt [1,2,3], max_tokens={a.max_tokens}, {a.connections} client connections, "
          f"request timeout {a.timeout:.0f} s")
    on = f"admission on (inflight {inflight}, queue {queue})"
    off = "admission off (baseline: limits 1e9)"
    on_out, rate = await run_mesh(on, {"EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT": str(inflight),
                                       "EMBEDMESH_WORKER_MAX_QUEUE": str(queue)}, a, body, a.rate or None)
    off_out, _ = await run_mesh(off, {"EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT": UNLIMITED,
                                      "EMBEDMESH_WORKER_MAX_QUEUE": UNLIMITED}, a, body, rate)
    report(rate, a.seconds, [(off, off_out), (on, on_out)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60, help="how long the overload is offered")
    ap.add_argument("--factor", type=float, default=4, help="offered rate = factor x measured capacity")
    ap.add_argument("--rate", type=float, default=0, help="offer this many req/s instead of measuring capacity")
    ap.add_argument("--levels", default="1,4,16,64", help="closed-loop concurrencies for the capacity probe")
    ap.add_argument("--probe-seconds", type=float, default=5)
    ap.add_argument("--p99-bound-ms", type=float, default=250)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--connections", type=int, default=1024, help="client connection pool size")
    ap.add_argument("--timeout", type=float, default=30, help="per request, seconds")
    ap.add_argument("--drain-seconds", type=float, default=35, help="wait for stragglers after the last send")
    ap.add_argument("--quick", action="store_true", help="15 s of overload, 3 s per capacity level")
    a, _ = ap.parse_known_args()
    if a.quick:
        a.seconds, a.probe_seconds = min(a.seconds, 15), min(a.probe_seconds, 3)
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()

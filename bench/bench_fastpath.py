"""Fast-path benchmark (issue #18): every mesh figure beside the LIMIT this machine reaches for the same shape
without the mesh, and the ratio mesh/limit — all measured in one run, on the same machine, at the same moment.

The limits are bare servers in their own processes (as the mesh's services are), started by this script and
killed at the end (also on Ctrl-C, SIGTERM or an exception), on the same event loop as the mesh's services
(uvloop when installed: ``core.server.run_service``; uvicorn picks it by itself):

  L1  a bare grpc.aio server (generic handlers on raw bytes, no interceptors): one unary hop, a unary_stream relay
      and a stream_unary sink.
  L2  a bare uvicorn + Starlette app (the gateway's uvicorn settings: uvloop, httptools): one POST route that
      orjson-parses the body and answers a small completion-shaped JSON, and one SSE route relaying events shaped
      like the gateway's. The overhead section also drives the same app on h11 (uvicorn's pure-Python parser) as a
      context row (driven by httpx, the httptools route once measured slower at 32 clients than the h11 one;
      driven by ``LightHttp`` it is about twice as fast).
  L3  L1's stream_unary sink receiving the 64 MiB tensor as 1 MiB chunks.
  L4  in this process: orjson.loads of the REST JSON body + pybase64.b64decode + numpy.frombuffer.
  L5  L1's unary sink receiving the 64 MiB tensor as one message (512 MiB message limits on both sides).
  L6  L2's app receiving the REST ingest body over HTTP and doing L4's work on it (orjson + pybase64): the same
      shape as the mesh's REST ingest up to the gateway, for context beside the goal's L4.

Sections (the mesh runs the echo engine: "x" x max_tokens at once, model "echo", hidden size 576):

  overhead  prompt [1,2,3], max_tokens=1, 1 and 32 concurrent clients: mesh gRPC (InferenceService.Generate) and
            REST (POST /v1/completions) vs L1 / L2. REST is driven by ``LightHttp`` (pre-built requests on
            keep-alive connections, responses parsed by httptools), since httpx costs the bench process more CPU
            per request than the bare route itself; the same two REST paths driven by httpx are printed beside them
            as context.
  stream    64 concurrent streaming clients, max_tokens=256 each: a streamed GenerateInline and SSE (read by
            ``LightHttp``) vs L1's relay of 256 one-token StreamCompleteResponse messages (and L2's relay of 256 SSE
            events), tokens/s in total.
  ingest    a 64 MiB float32 tensor (29127 x 576) as prompt_embeds, max_tokens=1: gRPC raw Tensor bytes and REST
            base64 of torch.save (sent by ``LightHttp``; by httpx too, as context) vs L3 / L4 (and L5, L6). MB/s
            of tensor bytes, median of the runs. Each payload is built once before timing, so the figures measure
            transport and decoding, not the client's encoding.

Runs are interleaved (limit, mesh, limit, mesh, ...) in rounds so that load from other work on the machine hits
both sides alike. The last line is ``FASTPATH_JSON {...}`` with every figure, ratio and goal.

    python bench/bench_fastpath.py [--quick] [--only overhead,stream,ingest]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# before anything imports grpc: the bare limits, the load generator and the mesh run gRPC's core alike
import embedmesh.core.grpc_runtime  # noqa: E402, F401, I001
import mesh_generate  # noqa: E402
from bench_mesh import drive, pct  # noqa: E402

from embedmesh.core.server import run_service  # noqa: E402
from tests.support.mesh import free_port, start_mesh  # noqa: E402

MODEL = "echo"
HIDDEN = 576
INGEST_ROWS = 29127  # x 576 x 4 bytes = 64 MiB
MiB = 1024 * 1024
STREAM_CLIENTS = 64
STREAM_TOKENS = 256
BARE_SERVICE = "/bench.Bare/"
SECTIONS = ("overhead", "stream", "ingest")

# What the Makefile's bench target exports: large buffers are reused instead of mmap'ed and faulted in per call.
BENCH_ENV = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "536870912",
             "MALLOC_TOP_PAD_": "268435456", "EMBEDMESH_TRACE_CONSOLE": "0"}

GOALS = {  # name -> (comparison, target)
    "grpc_added_p50_bare_hops": ("<=", 2.5),
    "rest_added_p50_bare_hops": ("<=", 4.0),
    "grpc_rps_pct_of_bare_c32": (">=", 40.0),
    "rest_rps_pct_of_bare_c32": (">=", 40.0),
    "grpc_p99_over_p50_c32": ("<=", 4.0),
    "rest_p99_over_p50_c32": ("<=", 4.0),
    "grpc_stream_pct_of_bare": (">=", 50.0),
    "grpc_ingest_pct_of_bare_chunked": (">=", 50.0),
    "grpc_one_message_ingest_pct_of_bare_chunked": (">=", 50.0),
    "rest_ingest_pct_of_bare_decode": (">=", 60.0),
}


# --------------------------------------------------------------------------------------------------------------
# Bare servers (run in child processes: ``bench_fastpath.py --serve grpc|http --port N``)
# --------------------------------------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """Exit this child if the benchmark that started it is gone (killed without cleaning up)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


async def _serve_grpc(port: int) -> None:
    import grpc

    from embedmesh.core.server import channel_options

    async def unary(request: bytes, context: Any) -> bytes:
        # One hop: answer a small message (the size of a one-token CompleteResponse does not matter at this size).
        return request

    async def relay(request: bytes, context: Any) -> Any:
        # First 4 bytes: how many messages; the rest: the message to send that many times.
        (n,) = struct.unpack_from("<I", request)
        msg = request[4:]
        for _ in range(n):
            yield msg

    async def sink_stream(requests: Any, context: Any) -> bytes:
        total = 0
        async for chunk in requests:
            total += len(chunk)
        return struct.pack("<Q", total)

    async def sink(request: bytes, context: Any) -> bytes:
        return struct.pack("<Q", len(request))

    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(relay),
        "Ingest": grpc.stream_unary_rpc_method_handler(sink_stream),
        "Big": grpc.unary_unary_rpc_method_handler(sink),
    })
    server = grpc.aio.server(options=channel_options(512 * MiB))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _serve_http(port: int, parser: str = "httptools") -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def complete(request: Request) -> Response:
        body = orjson.loads(await request.body())
        out = {"id": "cmpl-00000000000000000000000000000000", "object": "text_completion",
               "created": int(time.time()), "model": body.get("model", MODEL),
               "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        return Response(orjson.dumps(out), media_type="application/json")

    async def sse(request: Request) -> Response:
        # {"n": count, "event": "<json of one chunk>"}: relay that event n times, then [DONE], as the gateway does.
        body = orjson.loads(await request.body())
        n, ev = int(body["n"]), b"data: " + body["event"].encode() + b"\n\n"

        async def events() -> Any:
            for _ in range(n):
                yield ev
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def decode(request: Request) -> Response:
        # L6: the REST ingest's JSON/base64 work (L4) behind the same HTTP receive the gateway does.
        import pybase64

        body = orjson.loads(await request.body())
        data = pybase64.b64decode(body["prompt_embeds"], validate=True)
        return Response(orjson.dumps({"bytes": len(data)}), media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]),
                            Route("/sse", sse, methods=["POST"]), Route("/decode", decode, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="off",
                http=parser)  # httptools: as the gateway (h11 only for the context row beside L2)


def serve_main(kind: str, port: int, parent: int) -> None:
    _die_with_parent(parent)
    if kind == "grpc":
        run_service(_serve_grpc(port))  # the same event loop as the mesh's services
    else:
        _serve_http(port, "h11" if kind == "http-h11" else "httptools")


class BareServer:
    """A bare server in its own process group; ``stop()`` kills exactly that group."""

    def __init__(self, kind: str, env: dict[str, str]) -> None:
        self.kind = kind
        self.port = free_port()
        self.log = open(f"/tmp/bench-fastpath-{kind}-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--port", str(self.port),
             "--parent", str(os.getpid())],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=str(ROOT))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bare {self.kind} server exited ({self.proc.returncode}): {self._tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.1)
        raise RuntimeError(f"bare {self.kind} server not listening after {timeout}s: {self._tail()}")

    def _tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# --------------------------------------------------------------------------------------------------------------
# A light HTTP/1.1 load generator
# --------------------------------------------------------------------------------------------------------------

class _LightConnection(asyncio.Protocol):
    """One keep-alive connection; the response parsed by httptools (llhttp), chunked bodies de-chunked."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.on_piece: Callable[[bytes], None] | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, piece: bytes) -> None:
        if self.on_piece is not None:
            self.on_piece(piece)
        else:
            self.body.append(piece)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        body, self.body = b"".join(self.body), []
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the server closed the connection ({exc})"))


class LightHttp:
    """A load generator for the REST rows that costs the machine little: pre-built request bytes written on a pool
    of keep-alive connections, responses parsed in C. Through httpx (what the openai SDK uses) one bench process
    spends ~0.5 ms of CPU per request — more than the bare Starlette route itself (~0.14 ms round trip) — so at 32
    clients an httpx-driven L2 measured httpx, not the server (see docs/benchmarks.md)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition("//")[2].rpartition(":")
        self.host, self.port = host, int(port)
        self._free: list[_LightConnection] = []

    def post(self, path: str, body: bytes) -> bytes:
        """The whole request, built once and sent as many times as wanted."""
        return (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    async def send(self, request: bytes, on_piece: Callable[[bytes], None] | None = None) -> tuple[int, bytes]:
        """(status, body) of one request; with ``on_piece`` the body goes there piece by piece instead."""
        conn = None
        while self._free:
            conn = self._free.pop()
            if not conn.transport.is_closing():
                break
            conn = None
        if conn is None:
            _, conn = await asyncio.get_running_loop().create_connection(_LightConnection, self.host, self.port)
        conn.on_piece = on_piece
        conn.waiter = asyncio.get_running_loop().create_future()
        conn.transport.write(request)
        answer = await conn.waiter
        self._free.append(conn)
        return answer

    def close(self) -> None:
        for conn in self._free:
            conn.transport.close()
        self._free.clear()


# --------------------------------------------------------------------------------------------------------------
# Figures and printing
# --------------------------------------------------------------------------------------------------------------

def lat_stats(lat: list[float], wall: float) -> dict[str, float]:
    p50, p99 = pct(lat, 50), pct(lat, 99)
    return {"n": len(lat), "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "p99_over_p50": p99 / p50,
            "rps": len(lat) / wall}


def goal_line(name: str, value: float, unit: str, note: str = "") -> dict[str, Any]:
    op, target = GOALS[name]
    ok = value <= target if op == "<=" else value >= target
    print(f"  {name:<34} {value:8.2f} {unit:<14} goal {op} {target:<5g} {'ok' if ok else 'MISS'}"
          f"{'   ' + note if note else ''}")
    return {"value": value, "goal": f"{op} {target:g}", "ok": ok}


async def rounds(variants: dict[str, Callable[[], Awaitable[tuple[list[float], float]]]],
                 n_rounds: int) -> dict[str, tuple[list[float], float]]:
    """Run every variant once per round, in turn; pool latencies and wall time per variant."""
    pooled: dict[str, tuple[list[float], float]] = {k: ([], 0.0) for k in variants}
    for _ in range(n_rounds):
        for name, fn in variants.items():
            lat, wall = await fn()
            old_lat, old_wall = pooled[name]
            pooled[name] = (old_lat + lat, old_wall + wall)
    return pooled


# --------------------------------------------------------------------------------------------------------------
# (1) overhead
# --------------------------------------------------------------------------------------------------------------

async def bench_overhead(mesh: Any, bare_grpc: BareServer, bare_http: BareServer, n1: int, n32: int,
                         n_rounds: int, mesh_emb: Any = None, bare_h11: BareServer | None = None) -> dict[str, Any]:
    import grpc
    import httpx
    import orjson

    from embedmesh.core.sampling import SamplingParams
    from embedmesh.core.server import channel_options
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment
    from embedmesh.services.worker.engines.echo.engine import EchoEngine

    print("\n(1) overhead: prompt [1,2,3], max_tokens=1, echo engine; "
          f"{n_rounds} interleaved rounds of {n1} (1 client) / {n32} (32 clients) requests per path")
    engine = EchoEngine()
    counter = iter(range(10**9))

    async def in_process() -> None:
        req = GenerationRequest(f"r{next(counter)}", [TokenSegment((1, 2, 3))], SamplingParams(max_tokens=1))
        async for _ in engine.generate(req):
            pass

    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    raw_body = orjson.dumps(body)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    params = inference_pb2.CompletionParams(model=MODEL, prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
    params.sampling.max_tokens = 1
    greq = mesh_generate.request_bytes(params)
    small = inference_pb2.CompleteResponse(
        id="cmpl-00000000000000000000000000000000", model=MODEL,
        choices=[inference_pb2.Choice(index=0, text="x")]).SerializeToString()
    out: dict[str, Any] = {}
    emb = mesh_emb or mesh
    light = {name: LightHttp(address) for name, address in (
        ("mesh", mesh.base_url), ("emb", emb.base_url), ("bare", bare_http.address),
        ("h11", (bare_h11 or bare_http).address))}
    async with httpx.AsyncClient(base_url=mesh.base_url, limits=limits, timeout=60) as http, \
            httpx.AsyncClient(base_url=f"http://{bare_http.address}", limits=limits, timeout=60) as bare_h, \
            grpc.aio.insecure_channel(mesh.preprocessor, options=channel_options()) as ch, \
            grpc.aio.insecure_channel(emb.preprocessor, options=channel_options()) as ch_emb, \
            grpc.aio.insecure_channel(bare_grpc.address, options=channel_options()) as bare_ch:
        generate = mesh_generate.one_message(ch)
        generate_emb = mesh_generate.one_message(ch_emb)
        hop = bare_ch.unary_unary(BARE_SERVICE + "Unary")

        def rest(name: str) -> Callable[[], Awaitable[None]]:
            client = light[name]
            request = client.post("/v1/completions", raw_body)

            async def call() -> None:
                status, answer = await client.send(request)
                assert status == 200, answer
            return call

        async def mesh_grpc_emb() -> None:
            await mesh_generate.whole(generate_emb(greq))

        async def bare_grpc_call() -> None:
            await hop(small)

        async def mesh_grpc() -> None:
            await mesh_generate.whole(generate(greq))

        async def bare_rest_httpx() -> None:
            r = await bare_h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text

        async def mesh_rest_httpx() -> None:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text

        bare_rest, mesh_rest, mesh_rest_emb, bare_rest_h11 = rest("bare"), rest("mesh"), rest("emb"), rest("h11")

        paths = {"engine": ("engine in-process (reference)", in_process),
                 "bare_grpc": ("L1 bare grpc.aio unary hop", bare_grpc_call),
                 "mesh_grpc": ("mesh gRPC: preproc->router->worker", mesh_grpc),
                 "bare_rest": ("L2 bare uvicorn+Starlette POST", bare_rest),
                 "mesh_rest": ("mesh REST: gw->preproc->router->worker", mesh_rest),
                 "bare_rest_httpx": ("  L2 driven by httpx (context)", bare_rest_httpx),
                 "mesh_rest_httpx": ("  mesh REST driven by httpx (context)", mesh_rest_httpx)}
        limit_of = {"mesh_grpc": "bare_grpc", "mesh_rest": "bare_rest", "mesh_rest_httpx": "bare_rest_httpx"}
        if bare_h11 is not None:  # context, not a limit: the same route on uvicorn's pure-Python parser
            paths["bare_rest_h11"] = ("  L2 on h11 (context, not the limit)", bare_rest_h11)
        if mesh_emb is not None:  # the same mesh with the router inside the preprocessor (no routing hop)
            paths["mesh_grpc_emb"] = ("  gRPC, router in the preprocessor", mesh_grpc_emb)
            paths["mesh_rest_emb"] = ("  REST, router in the preprocessor", mesh_rest_emb)
            limit_of.update(mesh_grpc_emb="bare_grpc", mesh_rest_emb="bare_rest")
        for c, n in ((1, n1), (32, n32)):
            variants = {k: (lambda fn=fn, c=c, n=n: drive(fn, c, n)) for k, (_, fn) in paths.items()}
            pooled = await rounds(variants, n_rounds)
            res = {k: lat_stats(*v) for k, v in pooled.items()}
            for k, lim in limit_of.items():
                res[k]["p50_x_limit"] = res[k]["p50_ms"] / res[lim]["p50_ms"]
                res[k]["rps_pct_of_limit"] = 100 * res[k]["rps"] / res[lim]["rps"]
            out[f"c{c}"] = res
            print(f" {c} client{'s' if c > 1 else ''}:")
            print(f"  {'path':<38} {'p50 ms':>8} {'p99 ms':>8} {'p99/p50':>8} {'req/s':>8}   mesh/limit")
            for k, (label, _) in paths.items():
                s = res[k]
                extra = (f"   p50 x{s['p50_x_limit']:.2f}   req/s {s['rps_pct_of_limit']:.0f} %"
                         if k in limit_of else "")
                print(f"  {label:<38} {s['p50_ms']:8.3f} {s['p99_ms']:8.3f} {s['p99_over_p50']:8.2f} "
                      f"{s['rps']:8.0f}{extra}")
    for client in light.values():
        client.close()

    c1, c32 = out["c1"], out["c32"]
    eng = c1["engine"]["p50_ms"]
    g_added = (c1["mesh_grpc"]["p50_ms"] - eng) / c1["bare_grpc"]["p50_ms"]
    r_added = (c1["mesh_rest"]["p50_ms"] - eng) / c1["bare_rest"]["p50_ms"]
    r_added_grpc_hops = (c1["mesh_rest"]["p50_ms"] - eng) / c1["bare_grpc"]["p50_ms"]
    out["added_p50_ms_c1"] = {"grpc": c1["mesh_grpc"]["p50_ms"] - eng, "rest": c1["mesh_rest"]["p50_ms"] - eng}
    out["rest_added_p50_bare_grpc_hops"] = r_added_grpc_hops
    print(" goals (added = mesh p50 - engine in-process p50, at 1 client):")
    goals = {
        "grpc_added_p50_bare_hops": goal_line("grpc_added_p50_bare_hops", g_added, "L1 hops"),
        "rest_added_p50_bare_hops": goal_line("rest_added_p50_bare_hops", r_added, "L2 hops",
                                              f"(= {r_added_grpc_hops:.2f} L1 gRPC hops)"),
        "grpc_rps_pct_of_bare_c32": goal_line("grpc_rps_pct_of_bare_c32", c32["mesh_grpc"]["rps_pct_of_limit"],
                                              "% of L1"),
        "rest_rps_pct_of_bare_c32": goal_line("rest_rps_pct_of_bare_c32", c32["mesh_rest"]["rps_pct_of_limit"],
                                              "% of L2"),
        "grpc_p99_over_p50_c32": goal_line("grpc_p99_over_p50_c32", c32["mesh_grpc"]["p99_over_p50"], "",
                                           f"(1 client: {c1['mesh_grpc']['p99_over_p50']:.2f})"),
        "rest_p99_over_p50_c32": goal_line("rest_p99_over_p50_c32", c32["mesh_rest"]["p99_over_p50"], "",
                                           f"(1 client: {c1['mesh_rest']['p99_over_p50']:.2f})"),
    }
    if mesh_emb is not None:
        e_g = (c1["mesh_grpc_emb"]["p50_ms"] - eng) / c1["bare_grpc"]["p50_ms"]
        e_r = (c1["mesh_rest_emb"]["p50_ms"] - eng) / c1["bare_rest"]["p50_ms"]
        out["embedded_router"] = {"grpc_added_p50_bare_hops": e_g, "rest_added_p50_bare_hops": e_r,
                                  "grpc_rps_pct_of_bare_c32": c32["mesh_grpc_emb"]["rps_pct_of_limit"],
                                  "rest_rps_pct_of_bare_c32": c32["mesh_rest_emb"]["rps_pct_of_limit"]}
        print(f" with --embedded-router: gRPC added p50 {e_g:.2f} L1 hops, REST {e_r:.2f} L2 hops; 32 clients "
              f"gRPC {c32['mesh_grpc_emb']['rps_pct_of_limit']:.0f} % of L1, REST "
              f"{c32['mesh_rest_emb']['rps_pct_of_limit']:.0f} % of L2 (not counted in the goals)")
    if "bare_rest_h11" in c32:
        h11 = 100 * c32["mesh_rest"]["rps"] / c32["bare_rest_h11"]["rps"]
        out["rest_rps_pct_of_h11_c32"] = h11
        print(f" the same bare route on h11 (uvicorn's pure-Python parser; the gateway uses httptools, as L2 does): "
              f"32 clients {c32['bare_rest_h11']['rps']:.0f} req/s; mesh REST {h11:.0f} % of it (context)")
    hx_added = (c1["mesh_rest_httpx"]["p50_ms"] - eng) / c1["bare_rest_httpx"]["p50_ms"]
    out["rest_httpx"] = {"added_p50_bare_hops": hx_added,
                         "rps_pct_of_bare_c32": c32["mesh_rest_httpx"]["rps_pct_of_limit"],
                         "p99_over_p50_c32": c32["mesh_rest_httpx"]["p99_over_p50"]}
    print(f" both REST rows driven by httpx instead (context: the load generator then costs more CPU than the bare "
          f"route): {hx_added:.2f} L2 hops added; 32 clients {c32['mesh_rest_httpx']['rps_pct_of_limit']:.0f} % of "
          f"L2, p99/p50 {c32['mesh_rest_httpx']['p99_over_p50']:.2f} (L2 itself "
          f"{c32['bare_rest_httpx']['p99_over_p50']:.2f})")
    return {"figures": out, "goals": goals}


# --------------------------------------------------------------------------------------------------------------
# (2) token streaming
# --------------------------------------------------------------------------------------------------------------

def sse_tokens(buf: bytearray, chunk: bytes, parse: Callable[[bytes], Any]) -> tuple[int, bool]:
    """Feed ``chunk``; count the tokens (characters of choices[0].text) of the complete events in ``buf``."""
    buf += chunk
    n, done = 0, False
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return n, done
        ev = bytes(buf[:end])
        del buf[:end + 2]
        if ev.startswith(b"data: "):
            data = ev[6:]
            if data == b"[DONE]":
                done = True
            else:
                choices = parse(data)["choices"]
                if choices:
                    n += len(choices[0]["text"])


async def bench_stream(mesh: Any, bare_grpc: BareServer, bare_http: BareServer, per_client: int,
                       n_rounds: int) -> dict[str, Any]:
    import grpc
    import orjson

    from embedmesh.core.server import channel_options
    from embedmesh.inference.v1 import inference_pb2

    print(f"\n(2) token streaming: {STREAM_CLIENTS} concurrent clients x {per_client} streams each x "
          f"{STREAM_TOKENS} tokens, echo engine; {n_rounds} interleaved rounds")
    one_token = inference_pb2.StreamCompleteResponse(
        id="cmpl-c37d0a1ec54d40bc900d4ecd470cd95d", model=MODEL, index=0, text="x", token_ids=[87]
    ).SerializeToString()
    relay_req = struct.pack("<I", STREAM_TOKENS) + one_token
    sse_event = orjson.dumps({"id": "cmpl-2d9ce0e9db6b40d78c1fc28e3d949664", "object": "text_completion",
                              "created": int(time.time()), "model": MODEL,
                              "choices": [{"index": 0, "text": "x", "finish_reason": None, "logprobs": None}]})
    sse_req = orjson.dumps({"n": STREAM_TOKENS, "event": sse_event.decode()})
    params = inference_pb2.CompletionParams(model=MODEL, prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
    params.sampling.max_tokens = STREAM_TOKENS
    sreq = mesh_generate.request_bytes(params, stream=True)
    body = orjson.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": STREAM_TOKENS, "stream": True})
    light_mesh, light_bare = LightHttp(mesh.base_url), LightHttp(bare_http.address)
    mesh_sse_req, bare_sse_req = light_mesh.post("/v1/completions", body), light_bare.post("/sse", sse_req)
    async with grpc.aio.insecure_channel(mesh.preprocessor, options=channel_options()) as ch, \
            grpc.aio.insecure_channel(bare_grpc.address, options=channel_options()) as bare_ch:
        generate = mesh_generate.one_message(ch)
        relay = bare_ch.unary_stream(BARE_SERVICE + "Stream")

        async def bare_grpc_stream() -> int:
            n = 0
            async for _ in relay(relay_req):
                n += 1
            return n

        async def mesh_grpc_stream() -> int:
            n = 0
            async for m in generate(sreq):
                n += len(m.completion_chunk.token_ids)
            return n

        async def sse(client: LightHttp, request: bytes) -> int:
            n, done, buf = 0, False, bytearray()

            def piece(chunk: bytes) -> None:
                nonlocal n, done
                k, d = sse_tokens(buf, chunk, orjson.loads)
                n, done = n + k, done or d

            status, answer = await client.send(request, piece)
            assert status == 200, answer
            assert done, "stream ended without [DONE]"
            return n

        async def bare_sse() -> int:
            return await sse(light_bare, bare_sse_req)

        async def mesh_sse() -> int:
            return await sse(light_mesh, mesh_sse_req)

        async def closed_loop(fn: Callable[[], Awaitable[int]]) -> tuple[list[float], float]:
            """STREAM_CLIENTS clients, each running ``per_client`` streams back to back; one 'latency' per token
            count so ``rounds`` can pool: returns ([tokens], wall)."""
            await asyncio.gather(*[fn() for _ in range(8)])  # warm-up (connections, first-call paths)
            counts: list[float] = []

            async def client() -> None:
                for _ in range(per_client):
                    n = await fn()
                    assert n == STREAM_TOKENS, f"got {n} tokens, want {STREAM_TOKENS}"
                    counts.append(n)

            t0 = time.perf_counter()
            await asyncio.gather(*[client() for _ in range(STREAM_CLIENTS)])
            return counts, time.perf_counter() - t0

        paths = {"bare_grpc": ("L1 bare grpc.aio unary_stream relay", bare_grpc_stream),
                 "mesh_grpc": ("mesh gRPC GenerateInline (stream)", mesh_grpc_stream),
                 "bare_sse": ("L2 bare Starlette SSE relay", bare_sse),
                 "mesh_sse": ("mesh REST stream=true (SSE)", mesh_sse)}
        pooled = await rounds({k: (lambda fn=fn: closed_loop(fn)) for k, (_, fn) in paths.items()}, n_rounds)
    light_mesh.close()
    light_bare.close()

    res = {k: {"tokens": sum(v[0]), "streams": len(v[0]), "tok_s": sum(v[0]) / v[1], "streams_s": len(v[0]) / v[1]}
           for k, v in pooled.items()}
    lim = res["bare_grpc"]["tok_s"]
    res["mesh_grpc"]["pct_of_limit"] = 100 * res["mesh_grpc"]["tok_s"] / lim
    res["mesh_sse"]["pct_of_limit"] = 100 * res["mesh_sse"]["tok_s"] / lim
    res["mesh_sse"]["pct_of_bare_sse"] = 100 * res["mesh_sse"]["tok_s"] / res["bare_sse"]["tok_s"]
    print(f"  one relayed message: StreamCompleteResponse {len(one_token)} B; SSE event {len(sse_event) + 8} B")
    print(f"  {'path':<38} {'tokens/s':>10} {'streams/s':>10}   mesh/limit")
    for k, (label, _) in paths.items():
        s = res[k]
        extra = ""
        if k == "mesh_grpc":
            extra = f"   {s['pct_of_limit']:.0f} % of L1 relay"
        elif k == "mesh_sse":
            extra = f"   {s['pct_of_limit']:.0f} % of L1 relay, {s['pct_of_bare_sse']:.0f} % of L2 SSE relay"
        print(f"  {label:<38} {s['tok_s']:10.0f} {s['streams_s']:10.1f}{extra}")
    print(" goals:")
    goals = {"grpc_stream_pct_of_bare": goal_line("grpc_stream_pct_of_bare", res["mesh_grpc"]["pct_of_limit"],
                                                  "% of L1 relay",
                                                  f"(REST SSE: {res['mesh_sse']['pct_of_limit']:.0f} % of it)")}
    return {"figures": res, "goals": goals}


# --------------------------------------------------------------------------------------------------------------
# (3) ingest
# --------------------------------------------------------------------------------------------------------------

def chunks_of(data: bytes, size: int) -> Iterator[bytes]:
    view = memoryview(data)
    for i in range(0, len(data), size):
        yield bytes(view[i:i + size])


async def bench_ingest(mesh: Any, bare_grpc: BareServer, bare_http: BareServer, repeats: int) -> dict[str, Any]:
    import grpc
    import httpx
    import orjson
    import pybase64
    import torch

    from embedmesh.core.server import channel_options
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2

    arr = np.random.default_rng(0).standard_normal((INGEST_ROWS, HIDDEN), dtype=np.float32)
    raw = arr.tobytes()
    mb = arr.nbytes / 1e6
    print(f"\n(3) ingest: {INGEST_ROWS}x{HIDDEN} float32 = {arr.nbytes / MiB:.1f} MiB ({mb:.1f} MB) per request, "
          f"max_tokens=1, echo engine; median of {repeats} runs (after 1 warm-up), payloads built before timing")

    # REST body: base64 of torch.save, as bench_mesh sends it (and the openai SDK does).
    buf = io.BytesIO()
    torch.save(torch.from_numpy(arr), buf)
    saved = buf.getvalue()
    rest_body = orjson.dumps({"model": MODEL, "prompt": "", "max_tokens": 1,
                              "prompt_embeds": base64.b64encode(saved).decode()})
    data_offset = saved.find(raw[:64])
    assert data_offset >= 0 and saved[data_offset:data_offset + len(raw)] == raw
    # gRPC request: raw Tensor bytes, one message.
    t = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[INGEST_ROWS, HIDDEN], data=raw)
    params = inference_pb2.CompletionParams(model=MODEL, prompt_embeds=[inference_pb2.PromptEmbeds(tensor=t)])
    params.sampling.max_tokens = 1
    chunks = list(chunks_of(raw, MiB))

    def bare_decode() -> None:
        d = orjson.loads(rest_body)
        decoded = pybase64.b64decode(d["prompt_embeds"], validate=True)
        a = np.frombuffer(decoded, np.float32, count=arr.size, offset=data_offset).reshape(INGEST_ROWS, HIDDEN)
        assert a.shape == arr.shape

    bare_decode()
    dec = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        bare_decode()
        dec.append(time.perf_counter() - t0)

    light_mesh, light_bare = LightHttp(mesh.base_url), LightHttp(bare_http.address)
    mesh_rest_req = light_mesh.post("/v1/completions", rest_body)
    bare_rest_req = light_bare.post("/decode", rest_body)
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=300) as http, \
            grpc.aio.insecure_channel(mesh.preprocessor, options=channel_options()) as ch, \
            grpc.aio.insecure_channel(bare_grpc.address, options=channel_options(512 * MiB)) as bare_ch:
        complete_raw = mesh_generate.one_message(ch)
        greq_bytes = mesh_generate.request_bytes(params)
        complete_chunks = mesh_generate.pieces(ch)
        head = inference_pb2.CompletionParams()
        head.CopyFrom(params)
        head.prompt_embeds[0].tensor.ClearField("data")
        chunk_msgs = [mesh_generate.request_bytes(head)] + [
            inference_pb2.GenerateRequest(rows=c).SerializeToString() for c in chunks]
        ingest = bare_ch.stream_unary(BARE_SERVICE + "Ingest")
        big = bare_ch.unary_unary(BARE_SERVICE + "Big")

        async def bare_chunked() -> None:
            got = await ingest(iter(chunks))
            assert struct.unpack("<Q", got)[0] == len(raw)

        async def bare_one() -> None:
            got = await big(raw)
            assert struct.unpack("<Q", got)[0] == len(raw)

        async def mesh_grpc() -> None:
            r = await mesh_generate.whole(complete_raw(greq_bytes))  # serialized before timing, as the bare
            # limits' payloads are
            assert r.usage.completion_tokens == 1

        async def mesh_grpc_chunks() -> None:
            r = await mesh_generate.whole(complete_chunks(iter(chunk_msgs)))  # built before timing, as the bare
            # limits' payloads are
            assert r.usage.completion_tokens == 1

        async def bare_http_decode() -> None:
            status, answer = await light_bare.send(bare_rest_req)
            assert status == 200 and orjson.loads(answer)["bytes"] == len(saved), answer

        async def mesh_rest() -> None:
            status, answer = await light_mesh.send(mesh_rest_req)
            assert status == 200, answer

        async def mesh_rest_httpx() -> None:
            r = await http.post("/v1/completions", content=rest_body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text

        async def timed(fn: Callable[[], Awaitable[None]]) -> tuple[list[float], float]:
            t0 = time.perf_counter()
            await fn()
            dt = time.perf_counter() - t0
            return [dt], dt

        paths = {"bare_chunked": ("L3 bare grpc stream_unary, 1 MiB chunks", bare_chunked),
                 "bare_one": ("L5 bare grpc unary, one 64 MiB message", bare_one),
                 "mesh_grpc": ("mesh gRPC raw Tensor bytes, one message", mesh_grpc),
                 "mesh_grpc_chunks": ("mesh gRPC Generate, 1 MiB pieces", mesh_grpc_chunks),
                 "bare_http_decode": ("L6 bare Starlette route: body + L4's work", bare_http_decode),
                 "mesh_rest": ("mesh REST base64 torch.save", mesh_rest),
                 "mesh_rest_httpx": ("  the same sent by httpx (context)", mesh_rest_httpx)}
        for _, fn in paths.values():  # warm-up
            await fn()
        pooled = await rounds({k: (lambda fn=fn: timed(fn)) for k, (_, fn) in paths.items()}, repeats)
    light_mesh.close()
    light_bare.close()

    res = {k: {"median_ms": statistics.median(v[0]) * 1e3, "runs": len(v[0])} for k, v in pooled.items()}
    res["bare_decode"] = {"median_ms": statistics.median(dec) * 1e3, "runs": len(dec)}
    for s in res.values():
        s["mb_s"] = mb / (s["median_ms"] / 1e3)
    res["mesh_grpc"]["pct_of_limit"] = 100 * res["mesh_grpc"]["mb_s"] / res["bare_chunked"]["mb_s"]
    res["mesh_grpc_chunks"]["pct_of_limit"] = 100 * res["mesh_grpc_chunks"]["mb_s"] / res["bare_chunked"]["mb_s"]
    res["mesh_grpc"]["pct_of_one_message"] = 100 * res["mesh_grpc"]["mb_s"] / res["bare_one"]["mb_s"]
    res["mesh_rest"]["pct_of_limit"] = 100 * res["mesh_rest"]["mb_s"] / res["bare_decode"]["mb_s"]
    res["mesh_rest"]["pct_of_http"] = 100 * res["mesh_rest"]["mb_s"] / res["bare_http_decode"]["mb_s"]
    res["mesh_rest_httpx"]["pct_of_limit"] = 100 * res["mesh_rest_httpx"]["mb_s"] / res["bare_decode"]["mb_s"]
    labels = {"bare_chunked": paths["bare_chunked"][0], "bare_one": paths["bare_one"][0],
              "bare_decode": "L4 in-process orjson+b64decode+frombuffer",
              "mesh_grpc": paths["mesh_grpc"][0], "mesh_grpc_chunks": paths["mesh_grpc_chunks"][0],
              "bare_http_decode": paths["bare_http_decode"][0], "mesh_rest": paths["mesh_rest"][0],
              "mesh_rest_httpx": paths["mesh_rest_httpx"][0]}
    print(f"  {'path':<44} {'median ms':>10} {'MB/s':>8}   mesh/limit")
    for k in ("bare_chunked", "bare_one", "mesh_grpc_chunks", "mesh_grpc", "bare_decode", "bare_http_decode",
              "mesh_rest", "mesh_rest_httpx"):
        s = res[k]
        extra = ""
        if k == "mesh_grpc":
            extra = f"   {s['pct_of_limit']:.0f} % of L3, {s['pct_of_one_message']:.0f} % of L5"
        elif k == "mesh_grpc_chunks":
            extra = f"   {s['pct_of_limit']:.0f} % of L3 (the same shape: 1 MiB pieces)"
        elif k == "mesh_rest":
            extra = f"   {s['pct_of_limit']:.0f} % of L4, {s['pct_of_http']:.0f} % of L6"
        elif k == "mesh_rest_httpx":
            extra = f"   {s['pct_of_limit']:.0f} % of L4"
        print(f"  {labels[k]:<44} {s['median_ms']:10.1f} {s['mb_s']:8.0f}{extra}")
    print(" goals:")
    goals = {
        "grpc_ingest_pct_of_bare_chunked": goal_line("grpc_ingest_pct_of_bare_chunked",
                                                     res["mesh_grpc_chunks"]["pct_of_limit"], "% of L3",
                                                     "Generate pieces"),
        "grpc_one_message_ingest_pct_of_bare_chunked": goal_line(
            "grpc_one_message_ingest_pct_of_bare_chunked", res["mesh_grpc"]["pct_of_limit"], "% of L3",
            "GenerateInline, one message"),
        "rest_ingest_pct_of_bare_decode": goal_line("rest_ingest_pct_of_bare_decode",
                                                    res["mesh_rest"]["pct_of_limit"], "% of L4"),
    }
    return {"figures": res, "goals": goals}


# --------------------------------------------------------------------------------------------------------------

def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated: overhead,stream,ingest")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (about 2 minutes)")
    ap.add_argument("--serve", choices=("grpc", "http", "http-h11"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve_main(a.serve, a.port, a.parent)
        return 0
    parts = [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = set(parts) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if any(k not in os.environ for k in BENCH_ENV if k.startswith("MALLOC_")) \
            and not os.environ.get("BENCH_FASTPATH_REEXEC"):
        # glibc reads MALLOC_* at start only: re-run this process with them so the in-process limit (L4) runs
        # under the same allocator settings as the mesh and the bare servers. Values already set are kept.
        env = {**BENCH_ENV, **os.environ, "BENCH_FASTPATH_REEXEC": "1"}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    env = {**BENCH_ENV, **os.environ}
    env.pop("BENCH_FASTPATH_REEXEC", None)
    signal.signal(signal.SIGTERM, _on_sigterm)

    quick = a.quick
    print(f"fast-path benchmark: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, "
          f"{'quick' if quick else 'full'} run; limits L1..L6 measured in this run")
    result: dict[str, Any] = {"quick": quick, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        bare_grpc = BareServer("grpc", env)
        stack.callback(bare_grpc.stop)
        bare_http = BareServer("http", env)
        stack.callback(bare_http.stop)
        mesh = start_mesh(engine="echo", env=env, extra_args=["--router-process"])  # the router as a service
        stack.callback(mesh.stop)
        bare_grpc.wait_ready()
        bare_http.wait_ready()
        if "overhead" in parts:
            mesh_emb = start_mesh(engine="echo", env=env, extra_args=["--embedded-router"])
            bare_h11 = BareServer("http-h11", env)
            try:
                bare_h11.wait_ready()
                result["overhead"] = asyncio.run(bench_overhead(
                    mesh, bare_grpc, bare_http, n1=300 if quick else 1500, n32=800 if quick else 4000,
                    n_rounds=2 if quick else 5, mesh_emb=mesh_emb, bare_h11=bare_h11))
            finally:
                bare_h11.stop()
                mesh_emb.stop()
        if "stream" in parts:
            result["stream"] = asyncio.run(bench_stream(mesh, bare_grpc, bare_http, per_client=2 if quick else 4,
                                                        n_rounds=2 if quick else 5))
        if "ingest" in parts:
            result["ingest"] = asyncio.run(bench_ingest(mesh, bare_grpc, bare_http, repeats=3 if quick else 9))
    result["loadavg_end"] = os.getloadavg()[0]
    result["seconds"] = time.perf_counter() - started
    goals = {k: v for sec in SECTIONS if sec in result for k, v in result[sec]["goals"].items()}
    missed = [k for k, v in goals.items() if not v["ok"]]
    print(f"\ngoals met: {len(goals) - len(missed)}/{len(goals)}" + (f"; missed: {', '.join(missed)}" if missed else "")
          + f"   ({result['seconds']:.0f} s, load average {result['loadavg_end']:.2f} at end)")
    import orjson

    print("FASTPATH_JSON " + orjson.dumps(result).decode(), flush=True)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # the servers and the mesh were stopped on the way out
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None

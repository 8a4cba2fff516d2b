"""The front door at the peers' cost (issue 34): the mesh's REST gateway beside NVIDIA Dynamo 1.6.1's Rust frontend
and a bare Starlette route (the floor), driven by the same aiohttp client in interleaved rounds, in one run.

Systems (each in its own process tree, started and stopped by this script):

  embedmesh  ``python -m embedmesh.launcher --engine echo`` with the shipped defaults (``--mesh-args`` adds launcher
             flags); the echo engine answers "x" x max_tokens at once, so no model time.
  Dynamo     ``DYN_FILE_KV=<tmp> python -m dynamo.frontend --http-port P --discovery-backend file --request-plane tcp
             --router-mode kv`` and ``python -m dynamo.mocker --model-path <the converted SmolLM2 folder>
             --model-name echo --speedup-ratio 1e6 --discovery-backend file --request-plane tcp``, from its own venv
             (``make dynamo-venv``; built here if missing). No GPU, etcd or NATS.
  floor      a bare uvicorn + Starlette app (httptools, uvloop: the gateway's settings) in this file: parse the JSON
             body, answer a completion / chat completion of max_tokens "x" (one SSE event per token when streamed).

Shapes (prompt: the same 47 English words, tokenized by each server): tiny completion (max_tokens 1) at 1 client;
completion of 16 tokens at 16 clients; chat (one user message, 16 tokens) at 16 clients; streamed completion of 64
tokens at 16 clients, with time to first token (the first SSE event carrying text). Per shape and system: req/s,
p50/p99 latency, TTFT for streams, and server CPU per request: user + system time from ``/proc`` of the system's
whole process tree over the timed requests (warm-up excluded), the client (this process) excluded. Rounds are
interleaved (each system in turn, the order rotated each round) so load from other work on the machine hits all
alike. The mesh merges a stream's deltas into one SSE event when they arrive together, Dynamo sends one per token,
so streamed req/s and CPU are context; TTFT is the compared figure.

If the peer cannot be installed or started, the script says so and still measures the mesh and the floor.

    python bench/bench_peers.py [--quick] [--rounds N] [--mesh-args "--router-process"] [--no-install]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_mesh import pct  # noqa: E402

from tests.support.mesh import free_port, start_mesh  # noqa: E402

DYNAMO_VERSION = "1.6.1"
CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
DYNAMO_VENV = Path(os.environ.get("EMBEDMESH_DYNAMO_VENV") or CACHE / "venvs" / f"dynamo-{DYNAMO_VERSION}")
MODEL = "echo"
PROMPT = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp, watching ships pass "
          "through the fog while gulls circled overhead and waves crashed against the rocks below, and he wrote "
          "each name in a worn leather book that his grandfather had given him")
SYSTEMS = ("embedmesh", "dynamo", "floor")
LABELS = {"embedmesh": "embedmesh (echo engine)", "dynamo": f"Dynamo {DYNAMO_VERSION} frontend + mocker",
          "floor": "bare Starlette route (floor)"}


@dataclass(frozen=True)
class Shape:
    name: str
    path: str
    body: dict[str, Any]
    clients: int
    requests: int  # per round and system, full run (a quick run does a third)
    stream: bool = False


SHAPES = [
    Shape("tiny completion, 1 client", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, 1, 600),
    Shape("completion 16 tokens, 16 clients", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16}, 16, 1200),
    Shape("chat 16 tokens, 16 clients", "/v1/chat/completions",
          {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}, 16, 1200),
    Shape("streamed completion 64 tokens, 16 clients", "/v1/completions",
          {"prompt": PROMPT, "max_tokens": 64, "stream": True}, 16, 600, stream=True),
]


# --------------------------------------------------------------------------------------------------------------
# The floor: a bare Starlette app (``bench_peers.py --serve-floor PORT``)
# --------------------------------------------------------------------------------------------------------------

def serve_floor(port: int) -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def answer(request: Request) -> Response:
        body = orjson.loads(await request.body())
        chat = request.url.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or 16)
        head = {"id": "cmpl-00000000000000000000000000000000", "created": int(time.time()),
                "model": body.get("model", MODEL)}
        if body.get("stream"):
            kind = "chat.completion.chunk" if chat else "text_completion"

            async def events() -> Any:
                for i in range(n):
                    piece = {"delta": {"content": "x"}} if chat else {"text": "x"}
                    last = {"finish_reason": "length"} if i == n - 1 else {}
                    yield b"data: " + orjson.dumps({**head, "object": kind,
                                                    "choices": [{"index": 0, **piece, **last}]}) + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
        choice = {"message": {"role": "assistant", "content": "x" * n}} if chat else {"text": "x" * n}
        out = {**head, "object": "chat.completion" if chat else "text_completion",
               "choices": [{"index": 0, **choice, "finish_reason": "length", "logprobs": None}],
               "usage": {"prompt_tokens": 48, "completion_tokens": n, "total_tokens": 48 + n}}
        return Response(orjson.dumps(out), media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", answer, methods=["POST"]),
                            Route("/v1/chat/completions", answer, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="off", http="httptools",
                loop="uvloop")


# --------------------------------------------------------------------------------------------------------------
# Processes: started in their own session, killed by group; SIGTERM to them if this script dies without cleaning up
# --------------------------------------------------------------------------------------------------------------

def _die_with_me() -> None:  # preexec_fn: PR_SET_PDEATHSIG(SIGTERM)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


class Proc:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log_path = Path(tempfile.gettempdir()) / f"bench-peers-{name}-{os.getpid()}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                     start_new_session=True, preexec_fn=_die_with_me)  # noqa: PLW1509

    def tail(self, n: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _wait_http(url: str, procs: list[Proc], timeout: float, ready: Callable[[bytes], bool]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=2) as r:
            if ready(r.read()):
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n" + "\n".join(p.tail(600) for p in procs))


def start_floor(stack: contextlib.ExitStack) -> tuple[str, int]:
    port = free_port()
    p = Proc("floor", [sys.executable, str(Path(__file__).resolve()), "--serve-floor", str(port)], dict(os.environ))
    stack.callback(p.stop)
    deadline = time.monotonic() + 30
    while True:
        if p.proc.poll() is not None:
            raise RuntimeError(f"the floor server exited:\n{p.tail()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return f"http://127.0.0.1:{port}", p.proc.pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"the floor server is not listening after 30 s:\n{p.tail()}")
        time.sleep(0.1)


def model_dir() -> Path | None:
    """The converted SmolLM2 folder (``make model``) the mocker takes its tokenizer and config from."""
    found = sorted((CACHE / "models").glob("smollm2-*/config.json"))
    return found[-1].parent if found else None


def ensure_dynamo(install: bool) -> str | None:
    """None when the peer's venv is ready, else why not."""
    if (DYNAMO_VENV / ".complete").exists():
        return None
    if not install:
        return f"{DYNAMO_VENV} is not built (make dynamo-venv) and --no-install was given"
    print(f"... building the peer's venv (scripts/dynamo_venv.sh -> {DYNAMO_VENV})", flush=True)
    log = Path(tempfile.gettempdir()) / f"bench-peers-dynamo-venv-{os.getpid()}.log"
    with open(log, "wb") as f:
        code = subprocess.run(["bash", str(ROOT / "scripts" / "dynamo_venv.sh")], stdout=f, stderr=subprocess.STDOUT,
                              cwd=str(ROOT), env={**os.environ, "EMBEDMESH_DYNAMO_VENV": str(DYNAMO_VENV)}).returncode
    if code or not (DYNAMO_VENV / ".complete").exists():
        return f"scripts/dynamo_venv.sh failed ({code}); its log: {log}:\n{log.read_text(errors='replace')[-800:]}"
    return None


def start_dynamo(stack: contextlib.ExitStack, install: bool) -> tuple[str | None, list[int], str]:
    """(base URL, root pids, '') when the peer serves, else (None, [], why not). Stops what it started on failure."""
    why = ensure_dynamo(install)
    if why:
        return None, [], why
    model = model_dir()
    if model is None:
        return None, [], f"no converted SmolLM2 folder under {CACHE / 'models'} (make model)"
    kv = tempfile.mkdtemp(prefix="bench-peers-dynkv-")
    stack.callback(shutil.rmtree, kv, True)
    env = {**os.environ, "DYN_FILE_KV": kv, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    py = str(DYNAMO_VENV / "bin" / "python")
    port = free_port()
    common = ["--discovery-backend", "file", "--request-plane", "tcp"]
    procs = [Proc("dynamo-frontend", [py, "-m", "dynamo.frontend", "--http-port", str(port), *common,
                                      "--router-mode", "kv"], env),
             Proc("dynamo-mocker", [py, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", MODEL,
                                    "--speedup-ratio", "1e6", *common], env)]
    for p in procs:
        stack.callback(p.stop)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/v1/models", procs, 180, lambda b: f'"{MODEL}"'.encode() in b)
    except RuntimeError as e:
        for p in procs:
            p.stop()
        return None, [], f"the peer did not start: {e}"
    return url, [p.proc.pid for p in procs], ""


# --------------------------------------------------------------------------------------------------------------
# CPU of a process tree, from /proc
# --------------------------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, user + system seconds) for every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK)
    return out


def tree_cpu(roots: list[int]) -> dict[int, float]:
    """CPU seconds so far of each process in the trees under ``roots`` (roots included)."""
    table = _proc_table()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    out, todo = {}, list(roots)
    while todo:
        pid = todo.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            todo.extend(children[pid])
    return out


def process_label(pid: int) -> str:
    """A process's role: the module after ``-m`` (last two parts) or its executable's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    if "--serve-floor" in argv:
        return "starlette"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        parts = argv[argv.index("-m") + 1].split(".")
        parts = [p for p in parts if p not in ("embedmesh", "services", "main")] or parts
        return ".".join(parts[-2:])
    return Path(argv[0]).name


# --------------------------------------------------------------------------------------------------------------
# The client: one aiohttp session per system, a closed loop of N clients
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Figures:
    lat: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0  # seconds over the timed requests, whole tree
    client_cpu: float = 0.0  # this process's, over the same requests (context: is the client the bottleneck?)
    by_process: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def n(self) -> int:
        return len(self.lat)


def _first_text(buf: bytes, loads: Callable[[bytes], Any]) -> bool:
    """Whether the complete SSE events in ``buf`` include one carrying generated text."""
    for event in buf.split(b"\n\n")[:-1]:
        data = event.strip().removeprefix(b"data:").strip()
        if not data or data == b"[DONE]":
            continue
        for choice in loads(data).get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                return True
    return False


async def one_request(session: Any, url: str, raw: bytes, stream: bool) -> tuple[float, float]:
    """(latency, time to first text) of one request; TTFT is 0 for non-streamed ones."""
    import orjson

    t0 = time.perf_counter()
    async with session.post(url, data=raw, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:300]!r}")
        if not stream:
            await r.read()
            return time.perf_counter() - t0, 0.0
        ttft, buf = 0.0, b""
        async for chunk in r.content.iter_any():
            buf += chunk
            if not ttft and _first_text(buf, orjson.loads):
                ttft = time.perf_counter() - t0
        if not buf.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{url}: the stream ended without [DONE]: {buf[-200:]!r}")
        if not ttft:
            raise RuntimeError(f"{url}: the stream carried no text: {buf[:300]!r}")
        return time.perf_counter() - t0, ttft


def check_answer(shape: Shape, body: bytes, system: str) -> None:
    """A warm-up answer has the shape asked for: choices with generated text and, non-streamed, max_tokens of it."""
    import orjson

    answer = orjson.loads(body)
    choice = answer["choices"][0]
    text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
    if not text:
        raise RuntimeError(f"{system}: no generated text in {body[:300]!r}")
    got = (answer.get("usage") or {}).get("completion_tokens")
    if got != shape.body["max_tokens"]:
        raise RuntimeError(f"{system}: {got} completion tokens, asked for {shape.body['max_tokens']}")


async def batch(session: Any, url: str, shape: Shape, n: int, roots: list[int]) -> Figures:
    """``n`` requests of ``shape`` from ``shape.clients`` concurrent clients (after a short warm-up)."""
    raw = _body(shape)
    target = url + shape.path
    for _ in range(min(16, n)):
        await one_request(session, target, raw, shape.stream)
    fig = Figures()
    left = n

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            lat, ttft = await one_request(session, target, raw, shape.stream)
            fig.lat.append(lat)
            if shape.stream:
                fig.ttft.append(ttft)

    before = tree_cpu(roots)
    me = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(shape.clients)])
    fig.wall = time.perf_counter() - t0
    fig.client_cpu = time.process_time() - me
    after = tree_cpu(roots)
    for pid, cpu in after.items():
        spent = cpu - before.get(pid, 0.0)
        fig.cpu += spent
        fig.by_process[process_label(pid)] += spent
    return fig


def _body(shape: Shape) -> bytes:
    import orjson

    return orjson.dumps({"model": MODEL, **shape.body})


def merge(a: Figures, b: Figures) -> Figures:
    out = Figures(a.lat + b.lat, a.ttft + b.ttft, a.wall + b.wall, a.cpu + b.cpu, a.client_cpu + b.client_cpu)
    for src in (a.by_process, b.by_process):
        for k, v in src.items():
            out.by_process[k] += v
    return out


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------

async def measure(systems: dict[str, tuple[str, list[int]]], rounds: int, quick: bool,
                  failed: dict[str, str]) -> dict[str, dict[str, Figures]]:
    import aiohttp
    import orjson

    results: dict[str, dict[str, Figures]] = {s.name: {} for s in SHAPES}
    sessions = {name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64, limit_per_host=64),
                                            timeout=aiohttp.ClientTimeout(total=120))
                for name in systems}
    try:
        for shape in SHAPES:
            n = max(shape.requests // (3 if quick else 1), 50)
            print(f"... {shape.name}: {rounds} rounds x {n} requests per system", flush=True)
            for name, (url, _) in systems.items():
                if name in failed or shape.stream:
                    continue
                async with sessions[name].post(url + shape.path, data=_body(shape),
                                               headers={"content-type": "application/json"}) as r:
                    body = await r.read()
                try:
                    if r.status != 200:
                        raise RuntimeError(f"{name}: HTTP {r.status}: {body[:300]!r}")
                    check_answer(shape, body, name)
                except (RuntimeError, KeyError, IndexError, orjson.JSONDecodeError) as e:
                    if name != "dynamo":
                        raise
                    failed[name] = f"bad answer to {shape.name}: {e}"
            order = [k for k in systems if k not in failed]
            for r in range(rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    if name in failed:
                        continue
                    url, roots = systems[name]
                    try:
                        fig = await batch(sessions[name], url, shape, n, roots)
                    except (TimeoutError, RuntimeError, aiohttp.ClientError) as e:
                        if name != "dynamo":
                            raise
                        failed[name] = f"failed during {shape.name}: {e}"
                        continue
                    prev = results[shape.name].get(name)
                    results[shape.name][name] = merge(prev, fig) if prev else fig
    finally:
        for s in sessions.values():
            await s.close()
    return results


def _cell(fig: Figures | None, key: str) -> str:
    if fig is None or not fig.n:
        return "—"
    ms = 1e3
    return {"rps": f"{fig.n / fig.wall:.0f}", "p50": f"{pct(fig.lat, 50) * ms:.2f}",
            "p99": f"{pct(fig.lat, 99) * ms:.2f}",
            "ttft50": f"{pct(fig.ttft, 50) * ms:.2f}" if fig.ttft else "",
            "ttft99": f"{pct(fig.ttft, 99) * ms:.2f}" if fig.ttft else "",
            "cpu": f"{fig.cpu / fig.n * ms:.2f}"}[key]


def _ratio(a: Figures | None, b: Figures | None, key: str) -> str:
    if a is None or b is None or not a.n or not b.n:
        return "—"
    value = {"rps": lambda f: f.n / f.wall, "p50": lambda f: pct(f.lat, 50), "p99": lambda f: pct(f.lat, 99),
             "ttft50": lambda f: pct(f.ttft, 50) if f.ttft else 0.0,
             "ttft99": lambda f: pct(f.ttft, 99) if f.ttft else 0.0, "cpu": lambda f: f.cpu / f.n}[key]
    va, vb = value(a), value(b)
    return f"{va / vb:.2f}×" if vb else ""


KEYS = ("rps", "p50", "p99", "ttft50", "ttft99", "cpu")


def print_table(results: dict[str, dict[str, Figures]]) -> None:
    print("| shape | system | req/s | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms | server CPU ms/req |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        figs = results[shape.name]
        for i, name in enumerate(SYSTEMS):
            cells = [_cell(figs.get(name), k) for k in KEYS]
            print(f"| {shape.name if i == 0 else ''} | {LABELS[name]} | " + " | ".join(cells) + " |")
        ratios = [_ratio(figs.get("embedmesh"), figs.get("dynamo"), k) for k in KEYS]
        if shape.stream:  # one merged event against one per token: only TTFT is compared, the rest in brackets
            ratios = [f"({r})" if k not in ("ttft50", "ttft99") and r not in ("—", "") else r
                      for k, r in zip(KEYS, ratios, strict=True)]
        print("| | **embedmesh / Dynamo** | " + " | ".join(ratios) + " |")


def print_processes(results: dict[str, dict[str, Figures]]) -> None:
    print("\nServer CPU per request by process, ms (the same runs; the client's own beside it, not counted):")
    for shape in SHAPES:
        for name in SYSTEMS:
            fig = results[shape.name].get(name)
            if fig is None or not fig.n:
                continue
            parts = sorted(fig.by_process.items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{k} {v / fig.n * 1e3:.2f}" for k, v in parts if v / fig.n * 1e3 >= 0.005)
            print(f"  {shape.name:<42} {name:<10} {shown}; client {fig.client_cpu / fig.n * 1e3:.2f}")


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a third of the requests, 2 rounds (about 2-3 minutes)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 2 quick, 4 full)")
    ap.add_argument("--mesh-args", default="", help="extra launcher flags for the mesh, e.g. --router-process")
    ap.add_argument("--no-install", action="store_true", help="do not build the peer's venv when it is missing")
    ap.add_argument("--serve-floor", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_floor:
        serve_floor(a.serve_floor)
        return 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    rounds = a.rounds or (2 if a.quick else 4)
    # The mesh runs the shipped defaults: `make bench` exports EMBEDMESH_TRACE_CONSOLE=0 for the other benches.
    os.environ.pop("EMBEDMESH_TRACE_CONSOLE", None)
    load0 = os.getloadavg()
    started = time.perf_counter()
    print(f"front door at the peers' cost: {os.cpu_count()} CPUs, load average {load0[0]:.2f} / {load0[1]:.2f} / "
          f"{load0[2]:.2f} at start, {'quick' if a.quick else 'full'} run, {rounds} interleaved rounds; "
          f"prompt {len(PROMPT.split())} words; mesh: launcher --engine echo {a.mesh_args or '(shipped defaults)'}",
          flush=True)
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        print("... starting the floor and the mesh", flush=True)
        floor, floor_pid = start_floor(stack)
        mesh = start_mesh(engine=MODEL, extra_args=shlex.split(a.mesh_args))
        stack.callback(mesh.stop)
        print("... starting the peer", flush=True)
        dynamo, dynamo_roots, why = start_dynamo(stack, install=not a.no_install)
        systems = {"embedmesh": (mesh.base_url, [mesh.proc.pid])}
        if dynamo:
            systems["dynamo"] = (dynamo, dynamo_roots)
        else:
            failed["dynamo"] = why
            print(f"... the peer is not measured: {why}", flush=True)
        systems["floor"] = (floor, [floor_pid])
        results = asyncio.run(measure(systems, rounds, a.quick, failed))
    load1 = os.getloadavg()
    print()
    if "dynamo" in failed:
        print(f"PEER NOT MEASURED: Dynamo {DYNAMO_VERSION} — {failed['dynamo']}\n"
              "(the mesh and the floor below were measured; the ratio rows are empty)\n")
    print_table(results)
    print_processes(results)
    print(f"\nServer CPU: user + system of each system's whole process tree from /proc over the timed requests "
          f"(mesh: the launcher and its services; Dynamo: frontend + mocker; the client excluded). Streams: the "
          f"mesh sends one SSE event per stream here (echo's tokens arrive together), Dynamo and the floor one per "
          f"token, so only TTFT is compared. Both run their shipped defaults (Dynamo logs three INFO lines per "
          f"request to its log file). Load average {load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f} at the "
          f"end ({time.perf_counter() - started:.0f} s); the machine is shared.")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("\ninterrupted (everything it started was stopped)", file=sys.stderr)
        raise SystemExit(130) from None

"""Where the mesh's CPU goes on bench_peers.py's tiny completion (issue 34): py-spy on every service of an echo mesh
(shipped defaults) while one aiohttp client sends ``POST /v1/completions`` (the 47-word prompt, max_tokens 1), then
per process the samples by category (``CATEGORIES``) and the top functions (inclusive and self), with the CPU per
request from ``/proc``; ``--perf`` adds a flat ``perf record`` of each service (on-CPU time by library and symbol,
what py-spy shows as the event loop's own time); ``--svg`` writes flame graphs for docs/perf/; ``--ab`` instead
measures each lever on its own (``AB_VARIANTS``: meshes side by side, interleaved rounds). Findings:
docs/perf/front-door.md.

Needs py-spy (``pip install py-spy`` into any venv; pass ``--py-spy PATH``), perf for ``--perf``, and permission
to attach (root here).

    python bench/profile_front_door.py [--seconds 15] [--perf] [--svg docs/perf --tag before] [--mesh-args "..."]
    python bench/profile_front_door.py --ab [--ab-rounds 4 --ab-requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_peers import MODEL, PROMPT, model_dir, tree_cpu  # noqa: E402
from flamegraphs import service_pids  # noqa: E402

from tests.support.mesh import start_mesh  # noqa: E402

WHO = ("gateway", "preprocessor", "router", "worker")
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


async def load(url: str, seconds: float) -> int:
    import aiohttp
    import orjson

    body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    n = 0
    async with aiohttp.ClientSession() as s:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            async with s.post(url + "/v1/completions", data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            n += 1
    return n


def short(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (package/file.py)``: the last two parts of the path, no line."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    parts = Path(m["file"]).parts
    return f"{m['fn']} ({'/'.join(parts[-2:])})"


CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("tokenization", ("Tokenizer.encode", "tokenizers", "build_chat_prompt", "chat_template")),
    ("tracing (OpenTelemetry spans, propagation)", ("telemetry.py", "trace/", "propagat", "baggage", "context/",
                                                    "_decorator.py", "opentelemetry")),
    ("metrics (prometheus, Observed)", ("prometheus_client", "Observed.")),
    ("gRPC client calls (grpc.aio Python + Cython under it)", ("aio/_call.py", "aio/_channel.py",
                                                               "aio/_interceptor.py", "grpc/_common.py")),
    ("mux / worker streams (router and worker stream clients)", ("core/mux.py", "worker_stream.py",
                                                                  "route_client.py", "worker/many.py",
                                                                  "worker/coalesce.py")),
    ("gRPC server handler wrapping (admission, inbound checks)", ("_wrap_unary", "_wrap_stream", "_admit",
                                                                 "core/inbound.py", "_caller (core/server.py)")),
    ("HTTP server (uvicorn httptools, Starlette, SSE)", ("httptools_impl", "starlette/", "uvicorn/",
                                                         "gateway/protocol.py", "gateway/sse.py")),
    ("request parsing / translation (gateway)", ("gateway/requests", "gateway/translate.py",
                                                 "gateway/context.py", "orjson")),
    ("domain logic (prompts, pipeline, routing policy, engine)", ("preprocessor/", "router/", "worker/",
                                                                  "gateway/", "core/")),
]
"""(category, frame substrings): a sample goes to the category of the deepest frame (nearest the leaf) that matches."""


_ROOTS = ("main.py)", "<frozen runpy>", "run_service (", "asyncio/runners.py", "uvloop/__init__.py", "threading.py")
"""Frames every sample of a service's loop or threads passes through: never a category."""


def category(frames: list[str]) -> str:
    for f in reversed(frames):
        if any(r in f for r in _ROOTS):
            continue
        for name, needles in CATEGORIES:
            if any(n in f for n in needles):
                return name
    leaf = frames[-1] if frames else ""
    if leaf.startswith("Runner.run") or leaf.startswith("run (uvloop"):
        return "event loop's own time: uvloop + grpc.aio's Cython + syscalls (no Python frame)"
    if leaf.startswith("Thread.run"):
        return "gRPC poller thread (C core, socket I/O)"
    return "other Python (asyncio, stdlib)"


def summarize(raw: Path, requests: int, cpu_ms: float, top: int) -> list[str]:
    """The top functions of one py-spy raw (collapsed) file, as shares of its samples and ms of CPU per request."""
    self_, incl, cats, total = Counter(), Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        frames = [short(f) for f in stack.split(";")]
        total += k
        self_[frames[-1]] += k
        cats[category(frames)] += k
        for f in set(frames):
            if not any(r in f for r in _ROOTS):
                incl[f] += k
    if not total:
        return ["  (no samples)"]
    per = cpu_ms / total  # ms of CPU per request for one sample's share
    out = [f"  {total} samples; {cpu_ms:.2f} ms CPU per request over {requests} requests (from /proc)",
           "  by category (the deepest matching frame):"]
    out += [f"    {100 * v / total:5.1f} %  {v * per:6.3f} ms  {k}" for k, v in cats.most_common()]
    out.append("  inclusive (a function and what it calls):")
    out += [f"    {100 * v / total:5.1f} %  {v * per:6.3f} ms  {k}" for k, v in incl.most_common(top)]
    out.append("  self (the leaf that was running):")
    out += [f"    {100 * v / total:5.1f} %  {v * per:6.3f} ms  {k}" for k, v in self_.most_common(top)]
    return out


def perf_pass(pids: dict[str, str], url: str, seconds: float, folder: Path, top: int) -> None:
    """``perf record`` (no call graphs: flat samples, cheap) of each service under the same load; the shares of
    CPU by shared object and the top symbols."""
    data = {who: folder / f"perf-{who}.data" for who in pids}
    perfs = [subprocess.Popen(["perf", "record", "-F", "1999", "-p", pid, "-o", str(data[who]), "--", "sleep",
                               str(int(seconds))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for who, pid in pids.items()]
    n = asyncio.run(load(url, seconds))
    for p in perfs:
        p.wait(timeout=120)
    print(f"\nperf: {n} requests in {seconds:g} s with perf attached ({n / seconds:.0f} req/s)")
    for who in pids:
        for sort in ("dso", "dso,sym"):
            out = subprocess.run(["perf", "report", "-i", str(data[who]), "--stdio", "--sort", sort, "--percent-limit",
                                  "0.7" if sort == "dso,sym" else "0.5"], capture_output=True, text=True).stdout
            rows = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("#")][:top]
            print(f"\n{who} by {sort}:")
            print("\n".join("  " + r.strip() for r in rows))


AB_VARIANTS: list[tuple[str, list[str], dict[str, str], bool]] = [
    ("shipped defaults", [], {}, False),
    ("token-id prompt (no tokenization)", [], {}, True),
    ("EMBEDMESH_TRACING=off", [], {"EMBEDMESH_TRACING": "off"}, False),
    ("--router-process (the old default)", ["--router-process"], {}, False),
]
"""(label, launcher flags, environment, send the prompt as token ids): each a lever switched on its own."""


async def ab_batch(url: str, body: bytes, n: int, roots: dict[str, int]) -> tuple[list[float], dict[str, float]]:
    import aiohttp

    lat = []
    async with aiohttp.ClientSession() as s:
        async def one() -> None:
            async with s.post(url + "/v1/completions", data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status

        for _ in range(20):
            await one()
        before = {who: sum(tree_cpu([pid]).values()) for who, pid in roots.items()}
        for _ in range(n):
            t = time.perf_counter()
            await one()
            lat.append(time.perf_counter() - t)
        after = {who: sum(tree_cpu([pid]).values()) for who, pid in roots.items()}
    return lat, {who: after[who] - before[who] for who in roots}


def ab(rounds: int, n: int) -> None:
    """Each lever's mesh beside the shipped defaults, interleaved rounds of ``n`` sequential tiny completions."""
    import orjson
    from bench_mesh import pct

    text = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    meshes = []
    try:
        for label, args, env, ids in AB_VARIANTS:
            mesh = start_mesh(engine=MODEL, extra_args=args, env=env)
            meshes.append(mesh)
            roots = {k: int(v) for k, v in service_pids(mesh.proc.pid).items() if k in WHO}
            meshes[-1] = (label, mesh, roots, ids)
        ids_body = orjson.dumps({"model": MODEL, "prompt": _token_ids(), "max_tokens": 1})
        lat: dict[str, list[float]] = {v[0]: [] for v in meshes}
        per_round: dict[str, list[dict[str, float]]] = {v[0]: [] for v in meshes}
        for r in range(rounds):
            for label, mesh, roots, ids in meshes[r % len(meshes):] + meshes[:r % len(meshes)]:
                got, spent = asyncio.run(ab_batch(mesh.base_url, ids_body if ids else text, n, roots))
                lat[label] += got
                per_round[label].append({w: v / n * 1e3 for w, v in spent.items()})

        def med(label: str, who: str | None) -> float:
            return statistics.median(sum(x.values()) if who is None else x.get(who, 0.0) for x in per_round[label])

        base = med(AB_VARIANTS[0][0], None)
        print(f"\nlevers, one at a time: {rounds} interleaved rounds x {n} sequential tiny completions; CPU ms per "
              "request (user + system from /proc), median of the rounds [lowest-highest round]")
        print(f"  {'variant':<44}" + "".join(f"{w:>13}" for w in WHO)
              + f"{'sum':>8}{'rounds':>14}{'vs defaults':>13}{'p50 ms':>8}")
        for label, *_ in meshes:
            sums = [sum(x.values()) for x in per_round[label]]
            total = med(label, None)
            print(f"  {label:<44}" + "".join(f"{med(label, w):13.2f}" for w in WHO)
                  + f"{total:8.2f}{f'[{min(sums):.2f}-{max(sums):.2f}]':>14}{100 * (total - base) / base:+12.0f}%"
                  + f"{pct(lat[label], 50) * 1e3:8.2f}")
    finally:
        for m in meshes:
            (m[1] if isinstance(m, tuple) else m).stop()


def _token_ids() -> list[int]:
    """The prompt's token ids by the default model's tokenizer (the converted SmolLM2 folder)."""
    from tokenizers import Tokenizer

    folder = model_dir()
    assert folder is not None, "no converted model (make model)"
    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rate", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--mesh-args", default="")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    p.add_argument("--svg", default="", help="also write flame graphs (a second recording) into this folder")
    p.add_argument("--tag", default="now")
    p.add_argument("--ab", action="store_true", help="only the levers' A/B table (no profilers)")
    p.add_argument("--ab-rounds", type=int, default=6)
    p.add_argument("--ab-requests", type=int, default=150)
    p.add_argument("--perf", action="store_true", help="also a flat `perf record` of each service (C and kernel "
                   "time by library and symbol: what py-spy shows as the event loop's own time)")
    p.add_argument("--raw-dir", default="", help="keep the raw collapsed stacks here (default: a temporary folder)")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    a = p.parse_args()
    os.environ.pop("EMBEDMESH_TRACE_CONSOLE", None)  # the shipped defaults
    if a.ab:
        ab(a.ab_rounds, a.ab_requests)
        return 0
    raw_dir = Path(a.raw_dir or tempfile.mkdtemp(prefix="front-door-profile-"))
    raw_dir.mkdir(parents=True, exist_ok=True)
    mesh = start_mesh(engine=MODEL, extra_args=shlex.split(a.mesh_args))
    try:
        pids = {k: v for k, v in service_pids(mesh.proc.pid).items() if k in WHO}
        asyncio.run(load(mesh.base_url, 2.0))  # warm-up
        passes = [("raw", raw_dir, "txt")] + ([("flamegraph", Path(a.svg), "svg")] if a.svg else [])
        for fmt, folder, ext in passes:
            folder.mkdir(parents=True, exist_ok=True)
            files = {who: folder / (f"front-door-{who}-{a.tag}.{ext}") for who in pids}
            spies = [subprocess.Popen([a.py_spy, "record", "-p", pid, "-f", fmt, "-o", str(files[who]), "-r",
                                       str(a.rate), "-d", str(int(a.seconds)),
                                       *(["--native"] if a.native else ["--nonblocking"])],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for who, pid in pids.items()]
            before = {who: sum(tree_cpu([int(pid)]).values()) for who, pid in pids.items()}
            n = asyncio.run(load(mesh.base_url, a.seconds))
            after = {who: sum(tree_cpu([int(pid)]).values()) for who, pid in pids.items()}
            for s in spies:
                s.wait(timeout=120)
            cpu = {who: (after[who] - before[who]) / n * 1e3 for who in pids}
            print(f"{fmt}: {n} requests in {a.seconds:g} s with py-spy attached ({n / a.seconds:.0f} req/s); CPU ms "
                  "per request: " + ", ".join(f"{w} {c:.2f}" for w, c in cpu.items())
                  + f"; sum {sum(cpu.values()):.2f}")
            if fmt == "raw":
                for who in pids:
                    print(f"\n{who}:")
                    print("\n".join(summarize(files[who], n, cpu[who], a.top)))
            else:
                print("flame graphs: " + ", ".join(str(f) for f in files.values()))
        if a.perf:
            perf_pass(pids, mesh.base_url, a.seconds, raw_dir, a.top)
        print(f"\nraw stacks in {raw_dir}")
    finally:
        mesh.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Soak: N concurrent clients mix four kinds of request through the gateway of a real mesh (hf worker, SmolLM2;
hf-embed worker) for a long while; prints requests/s per kind, every error, and the RSS and open file descriptors of
every mesh process at the start, the middle and the end (they should stay flat after warm-up).

Kinds, round-robin per client:
  text    /v1/completions with a text prompt
  embeds  /v1/completions with ``prompt_embeds`` (rows of the model's own embedding table for random token ids,
          torch.save + base64, as vLLM's docs tell clients to build them)
  chat    /v1/chat/completions with a text part and a ``prompt_embeds`` part
  embed   /v1/embeddings (all-MiniLM-L6-v2)
Baseline, measured in the same run: each kind alone, one client, before the load starts.

    python bench/soak.py [--clients 32] [--seconds 600] [--max-tokens 6]      # make soak
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import Mesh, start_mesh  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
EMBED_MODEL = "all-MiniLM-L6-v2"
HIDDEN = 576
KINDS = ("text", "embeds", "chat", "embed")
WORDS = ("mesh", "token", "river", "quiet", "engine", "orange", "window", "seven", "paper", "cloud", "stone",
         "garden", "signal", "amber", "bridge", "winter", "lamp", "harbor", "violet", "circuit")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------------------------------------- mesh processes


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # comm may hold spaces and parentheses: the fields after the last ')' are fixed.
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def mesh_pids(root: int) -> list[int]:
    """The launcher and all its descendants (its children run in their own sessions, so walk /proc by ppid)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = _ppid(int(name))
            if pp is not None:
                parent[int(name)] = pp
    found, frontier = [root], [root]
    while frontier:
        p = frontier.pop()
        kids = sorted(c for c, pp in parent.items() if pp == p)
        found.extend(kids)
        frontier.extend(kids)
    return found


def proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return f"pid {pid}"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        module = argv[argv.index("-m") + 1]
        parts = module.split(".")
        short = parts[-2] if parts[-1] == "main" and len(parts) > 1 else parts[-1]
        port = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--port"), "")
        return f"{short}:{port}" if port else short
    return Path(argv[0]).name if argv else f"pid {pid}"


def proc_usage(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, open fds) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def snapshot(mesh: Mesh) -> dict[int, tuple[str, float, int]]:
    out = {}
    for pid in mesh_pids(mesh.proc.pid):
        usage = proc_usage(pid)
        if usage is not None:
            out[pid] = (proc_name(pid), *usage)
    return out


def print_usage(snaps: list[tuple[str, dict[int, tuple[str, float, int]]]]) -> None:
    pids: list[int] = []
    for _, s in snaps:
        pids.extend(p for p in s if p not in pids)
    head = "".join(f"{label:>22}" for label, _ in snaps)
    print(f"\nmesh processes: RSS MiB / open fds{'':<8}{head}{'Δ RSS mid→end':>16}{'Δ fds':>8}")
    for pid in pids:
        name = next(s[pid][0] for _, s in snaps if pid in s)
        cells = "".join(f"{s[pid][1]:>14.1f} / {s[pid][2]:>5}" if pid in s else f"{'gone':>22}" for _, s in snaps)
        mid, end = snaps[len(snaps) // 2][1].get(pid), snaps[-1][1].get(pid)
        delta = f"{end[1] - mid[1]:>+16.1f}{end[2] - mid[2]:>+8d}" if mid and end else ""
        print(f"  {name:<22} pid {pid:<8}{cells}{delta}")


# ---------------------------------------------------------------------------------------------- request makers


class Requests:
    """Builds a fresh body for each kind (random words / token ids, so no cache answers a repeated prompt)."""

    def __init__(self, model: str, embed_model: str, max_tokens: int, seed: int) -> None:
        import torch

        from embedmesh.models import ensure_default_model

        self.torch = torch
        self.model, self.embed_model, self.max_tokens = model, embed_model, max_tokens
        self.rng = random.Random(seed)
        try:
            from safetensors import safe_open

            with safe_open(str(Path(ensure_default_model()) / "model.safetensors"), "pt") as f:
                self.table = f.get_tensor("model.embed_tokens.weight").float()
        except Exception as e:  # noqa: BLE001 - no local weights: rows with the table's scale instead
            print(f"(embedding table unavailable: {e}; using random rows of std 0.136)")
            self.table = torch.randn(49152, HIDDEN) * 0.136

    def _text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _embeds_b64(self) -> str:
        ids = self.torch.tensor([self.rng.randrange(self.table.shape[0]) for _ in range(self.rng.randint(4, 16))])
        buf = io.BytesIO()
        self.torch.save(self.table[ids].clone(), buf)
        return base64.b64encode(buf.getvalue()).decode()

    def build(self, kind: str) -> tuple[str, dict[str, Any]]:
        mt = self.max_tokens
        if kind == "text":
            return "/v1/completions", {"model": self.model, "prompt": self._text(self.rng.randint(4, 24)),
                                       "max_tokens": mt}
        if kind == "embeds":
            return "/v1/completions", {"model": self.model, "prompt_embeds": self._embeds_b64(), "max_tokens": mt}
        if kind == "chat":
            content = [{"type": "text", "text": f"Describe {self._text(3)}:"},
                       {"type": "prompt_embeds", "data": self._embeds_b64()}]
            return "/v1/chat/completions", {"model": self.model, "max_tokens": mt,
                                            "messages": [{"role": "user", "content": content}]}
        inputs = [self._text(self.rng.randint(3, 12)) for _ in range(self.rng.randint(1, 4))]
        return "/v1/embeddings", {"model": self.embed_model, "input": inputs}


def check(kind: str, status: int, body: Any) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {str(body)[:200]}")
    if kind == "embed":
        ok = bool(body.get("data")) and all(d.get("embedding") for d in body["data"])
    elif kind == "chat":
        ok = bool(body.get("choices")) and body["choices"][0].get("message") is not None
    else:
        ok = bool(body.get("choices")) and isinstance(body["choices"][0].get("text"), str)
    if not ok:
        raise RuntimeError(f"HTTP 200 without a usable answer: {str(body)[:200]}")


async def pick_models(http: Any) -> tuple[str, str]:
    r = await http.get("/v1/models")
    ids = [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
    gen = MODEL if MODEL in ids or not ids else next((i for i in ids if "MiniLM" not in i), MODEL)
    emb = EMBED_MODEL if EMBED_MODEL in ids or not ids else next((i for i in ids if "MiniLM" in i), EMBED_MODEL)
    return gen, emb


# ---------------------------------------------------------------------------------------------- the soak


class Stats:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.messages: list[str] = []
        self.window: dict[str, int] = defaultdict(int)  # completions since the last progress row

    def ok(self, kind: str, seconds: float) -> None:
        self.lat[kind].append(seconds)
        self.window[kind] += 1

    def fail(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.messages) < 5:
            self.messages.append(f"{kind}: {message}")


async def run(a: argparse.Namespace) -> int:
    import httpx

    print(f"soak: {a.clients} clients, {a.seconds:.0f} s, max_tokens {a.max_tokens}, kinds {', '.join(KINDS)}; "
          "starting the mesh (hf worker + hf-embed worker) ...", flush=True)
    mesh = start_mesh(env={"EMBEDMESH_TRACE_CONSOLE": "0"})
    stats = Stats()
    try:
        limits = httpx.Limits(max_connections=a.clients + 8, max_keepalive_connections=a.clients + 8)
        async with httpx.AsyncClient(base_url=mesh.base_url, limits=limits, timeout=a.timeout) as http:
            model, embed_model = await pick_models(http)
            reqs = Requests(model, embed_model, a.max_tokens, a.seed)

            async def send(kind: str) -> float:
                path, body = reqs.build(kind)
                t = time.perf_counter()
                r = await http.post(path, json=body)
                seconds = time.perf_counter() - t
                check(kind, r.status_code, r.json() if r.headers.get("content-type", "").startswith(
                    "application/json") else r.text)
                return seconds

            # Baseline: each kind alone, one client (after one warm-up request of each).
            base: dict[str, list[float]] = {k: [] for k in KINDS}
            for i in range(4):
                for kind in KINDS:
                    s = await send(kind)
                    if i:
                        base[kind].append(s)

            snaps = [("start", snapshot(mesh))]
            t0 = time.perf_counter()
            end = t0 + a.seconds
            middle_taken = asyncio.Event()

            async def client(idx: int) -> None:
                n = idx
                while time.perf_counter() < end:
                    kind = KINDS[n % len(KINDS)]
                    n += 1
                    try:
                        stats.ok(kind, await send(kind))
                    except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                        stats.fail(kind, f"{type(e).__name__}: {e}"[:300])

            async def monitor() -> None:
                step = max(1.0, a.seconds / 10)
                last = t0
                print(f"\n{'t (s)':>7}" + "".join(f"{k + ' req/s':>14}" for k in KINDS) + f"{'errors':>9}")
                while True:
                    await asyncio.sleep(min(step, max(0.0, end - time.perf_counter())) or step)
                    now = time.perf_counter()
                    if not middle_taken.is_set() and now - t0 >= a.seconds / 2:
                        snaps.append(("middle", await asyncio.to_thread(snapshot, mesh)))
                        middle_taken.set()
                    rates = "".join(f"{stats.window[k] / (now - last):>14.2f}" for k in KINDS)
                    print(f"{now - t0:>7.0f}{rates}{sum(stats.errors.values()):>9}", flush=True)
                    stats.window.clear()
                    last = now
                    if now >= end:
                        return

            mon = asyncio.create_task(monitor())
            await asyncio.gather(*[client(i) for i in range(a.clients)])
            wall = time.perf_counter() - t0
            mon.cancel()
            if not middle_taken.is_set():
                snaps.append(("middle", snapshot(mesh)))
            snaps.append(("end", snapshot(mesh)))
    finally:
        code = mesh.stop()

    total_ok = sum(len(v) for v in stats.lat.values())
    total_err = sum(stats.errors.values())
    print(f"\nper kind over {wall:.0f} s ({a.clients} clients){'':<6}"
          f"{'ok':>8}{'errors':>8}{'req/s':>9}{'p50 ms':>10}{'p99 ms':>10}   baseline: 1 client alone p50 ms")
    for kind in KINDS:
        lat = stats.lat[kind]
        print(f"  {kind:<44}{len(lat):>8}{stats.errors[kind]:>8}{len(lat) / wall:>9.2f}"
              f"{pct(lat, 50) * 1e3:>10.0f}{pct(lat, 99) * 1e3:>10.0f}   {statistics.median(base[kind]) * 1e3:>10.0f}")
    print(f"  {'all':<44}{total_ok:>8}{total_err:>8}{total_ok / wall:>9.2f}")
    print_usage(snaps)
    print(f"\nerrors: {total_err} (the goal is 0)")
    for m in stats.messages:
        print(f"  {m}")
    if code != 0:
        print(f"launcher exit code {code} (0 expected); log tail:\n{mesh.log_tail(2000)}")
    return 1 if total_err or code != 0 else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--max-tokens", type=int, default=6, help="per completion (small: the model runs on CPU)")
    ap.add_argument("--timeout", type=float, default=300, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    a, _ = ap.parse_known_args()
    return asyncio.run(run(a))


if __name__ == "__main__":
    raise SystemExit(main())

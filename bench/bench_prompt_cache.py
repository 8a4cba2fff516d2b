"""The preprocessor's prompt cache (``preprocessor/token_cache.py``) on multi-turn chat with a long shared system
prompt: an echo mesh, N closed-loop clients each holding a conversation (the same ~8k-token system prompt, then
its own turns, every request sending the whole history as chat completions do), runs alternating cache on / off
(``EMBEDMESH_PREPROCESSOR_PROMPT_CACHE_BYTES=0``), each in a fresh mesh. Per run: requests/s, latency p50/p99,
and the preprocessor's CPU per request (``/proc``, its whole process). The ratios are medians of the pairs.

Last line: ``prompt_cache: rps_on_over_off=X cpu_on_over_off=Y``.

    python bench/bench_prompt_cache.py [--quick] [--clients N] [--seconds S] [--pairs P]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from bench_cpu import cpu_seconds  # noqa: E402
from flamegraphs import service_pids  # noqa: E402

from tests.support.mesh import start_mesh  # noqa: E402

SYSTEM = " ".join(f"Rule {i}: answer with care, cite the clause, and keep the tone even." for i in range(620))
"""About 8k tokens of SmolLM2's tokenizer."""
TURNS = 10


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _client(c: httpx.AsyncClient, index: int, until: float, latencies: list[float]) -> None:
    history: list[dict[str, str]] = []
    turn = 0
    while time.monotonic() < until:
        if turn == TURNS:
            history, turn = [], 0
        history.append({"role": "user", "content": f"Client {index}, question {turn}: how does rule {turn} apply?"})
        t0 = time.perf_counter()
        r = await c.post("/v1/chat/completions", json={
            "model": "echo", "max_tokens": 8, "messages": [{"role": "system", "content": SYSTEM}, *history]})
        r.raise_for_status()
        latencies.append(time.perf_counter() - t0)
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        turn += 1


async def _drive(base_url: str, clients: int, seconds: float) -> tuple[list[float], float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(_client(c, i, t0 + seconds, latencies) for i in range(clients)))
        return latencies, time.monotonic() - t0


def _run(cache_on: bool, clients: int, seconds: float) -> dict[str, float]:
    env = {"EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT": "1024"}
    if not cache_on:
        env["EMBEDMESH_PREPROCESSOR_PROMPT_CACHE_BYTES"] = "0"
    mesh = start_mesh(engine="echo", workers=1, env=env)
    try:
        pid = service_pids(mesh.proc.pid)["preprocessor"]
        asyncio.run(_drive(mesh.base_url, 2, 2.0))  # warm-up (and, with the cache, the system prompt cached)
        before = cpu_seconds(pid)
        latencies, elapsed = asyncio.run(_drive(mesh.base_url, clients, seconds))
        cpu = cpu_seconds(pid) - before
    finally:
        mesh.stop()
    n = len(latencies)
    return {"rps": n / elapsed, "p50": _pct(latencies, 0.5) * 1e3, "p99": _pct(latencies, 0.99) * 1e3,
            "cpu": cpu / max(n, 1) * 1e3, "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer pairs")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=0.0, help="length of each run (default 20, --quick 8)")
    ap.add_argument("--pairs", type=int, default=0, help="on/off pairs (default 3, --quick 2)")
    a = ap.parse_args()
    seconds = a.seconds or (8.0 if a.quick else 20.0)
    pairs = a.pairs or (2 if a.quick else 3)
    print(f"prompt cache: echo mesh, {a.clients} clients, chats of up to {TURNS} turns after a shared ~8k-token "
          f"system prompt (the whole history sent each turn), {seconds:g} s per run, {pairs} on/off pairs", flush=True)
    rows: list[tuple[str, dict[str, float]]] = []
    ratios_rps, ratios_cpu = [], []
    for i in range(pairs):
        pair = {}
        for on in (True, False) if i % 2 == 0 else (False, True):
            print(f"... pair {i + 1}, cache {'on' if on else 'off'}", flush=True)
            pair[on] = _run(on, a.clients, seconds)
            rows.append((f"{i + 1}, cache {'on' if on else 'off'}", pair[on]))
        ratios_rps.append(pair[True]["rps"] / pair[False]["rps"])
        ratios_cpu.append(pair[True]["cpu"] / pair[False]["cpu"])
    print("\n| run | requests | req/s | p50 ms | p99 ms | preprocessor CPU ms/request |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['n']:.0f} | {r['rps']:.1f} | {r['p50']:.0f} | {r['p99']:.0f} | {r['cpu']:.1f} |")
    x, y = statistics.median(ratios_rps), statistics.median(ratios_cpu)
    print("\nRatios are medians over the pairs (each pair run back to back, order alternating). The gateway and the "
          "client share this machine's 2 cores with the preprocessor, so req/s is bounded by more than the "
          "preprocessor's work; its CPU per request is the direct measure of the cache.")
    print(f"prompt_cache: rps_on_over_off={x:.2f} cpu_on_over_off={y:.2f}")


if __name__ == "__main__":
    main()

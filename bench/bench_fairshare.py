"""Weighted fair share under saturation, measured through a real mesh (one mocker worker, the preprocessor's
``--fair-share-slots``): tenant B alone; then tenant A offering ten times B's load (closed-loop clients: 10x the
concurrency) beside B, with keys weighted 4:1, once with fair share and once first come, first served (the setting
off: the worker's own queue decides). Streamed completions through the gateway with API keys (httpx); per tenant:
TTFT p50/p99 and tokens served; in all: tokens/s.

Last line: ``fairshare: b_p99_over_alone=X served_ratio=Y throughput_over_fcfs=Z b_p99_fcfs_over_alone=W``.

    python bench/bench_fairshare.py [--quick] [--seconds S] [--slots N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.support.mesh import start_mesh  # noqa: E402

KEYS = {"a": ("tenant-a-key-0001", 4), "b": ("tenant-b-key-0001", 1)}
MAX_TOKENS = 6


@dataclass
class Tenant:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _client(c: httpx.AsyncClient, key: str, out: Tenant, until: float) -> None:
    while time.monotonic() < until:
        t0 = time.monotonic()
        first = None
        try:
            async with c.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "mocker", "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
                                      "max_tokens": MAX_TOKENS, "stream": True}) as r:
                if r.status_code != 200:
                    out.failed += 1
                    await asyncio.sleep(0.05)
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and first is None:
                        first = time.monotonic() - t0
        except httpx.HTTPError:
            out.failed += 1
            continue
        if first is not None:
            out.ttft.append(first)
            out.tokens += MAX_TOKENS


async def _drive(base_url: str, concurrency: dict[str, int], seconds: float) -> tuple[dict[str, Tenant], float]:
    tenants = {name: Tenant() for name in concurrency}
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=200)) as c:
        until = time.monotonic() + seconds
        t0 = time.monotonic()
        await asyncio.gather(*(_client(c, KEYS[name][0], tenants[name], until)
                               for name, n in concurrency.items() for _ in range(n)))
        elapsed = time.monotonic() - t0
    return tenants, elapsed


def _scenario(keys: Path, slots: int, concurrency: dict[str, int], seconds: float) -> tuple[dict[str, Tenant], float]:
    mesh = start_mesh(engine="mocker", workers=1, env={
        "EMBEDMESH_API_KEYS_FILE": str(keys), "EMBEDMESH_PREPROCESSOR_FAIR_SHARE_SLOTS": str(slots),
        "EMBEDMESH_WORKER_MOCKER_DECODE_MS": "20", "EMBEDMESH_TRACE_CONSOLE": "0"})
    try:
        asyncio.run(_drive(mesh.base_url, {"b": 1}, 1.0))  # warm-up
        return asyncio.run(_drive(mesh.base_url, concurrency, seconds))
    finally:
        mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--seconds", type=float, default=0.0, help="length of each run (default 6, --quick 4)")
    ap.add_argument("--slots", type=int, default=8, help="--fair-share-slots of the fair runs (the worker's batch: 8)")
    ap.add_argument("--b-clients", type=int, default=2, help="tenant B's closed-loop clients (A gets 10x)")
    a = ap.parse_args()
    seconds = a.seconds or (4.0 if a.quick else 6.0)
    keys = Path(tempfile.mkdtemp(prefix="embedmesh-fair-")) / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": k, "tenant": f"tenant-{n}", "weight": w}
                                         for n, (k, w) in KEYS.items()]}))
    both = {"a": 10 * a.b_clients, "b": a.b_clients}
    print(f"fair share: 1 mocker worker (20 ms decode steps, batch 8), {MAX_TOKENS}-token streamed completions, "
          f"weights A:B = {KEYS['a'][1]}:{KEYS['b'][1]}, {seconds:g} s per run", flush=True)
    print("... B alone", flush=True)
    alone, t_alone = _scenario(keys, a.slots, {"b": a.b_clients}, seconds)
    print("... A (10x) + B, fair share", flush=True)
    fair, t_fair = _scenario(keys, a.slots, both, seconds)
    print("... A (10x) + B, first come first served", flush=True)
    fcfs, t_fcfs = _scenario(keys, 0, both, seconds)

    print("\n| run | B TTFT p50 ms | B TTFT p99 ms | A TTFT p99 ms | A tokens | B tokens | A:B | tokens/s | failed |")
    print("|---|---|---|---|---|---|---|---|---|")

    def row(name: str, t: dict[str, Tenant], elapsed: float) -> None:
        b, aa = t["b"], t.get("a", Tenant())
        ratio = aa.tokens / b.tokens if b.tokens and aa.tokens else float("nan")
        print(f"| {name} | {_pct(b.ttft, 0.5) * 1e3:.0f} | {_pct(b.ttft, 0.99) * 1e3:.0f} | "
              f"{_pct(aa.ttft, 0.99) * 1e3:.0f} | {aa.tokens} | {b.tokens} | {ratio:.2f} | "
              f"{(aa.tokens + b.tokens) / elapsed:.0f} | {aa.failed + b.failed} |")

    row(f"B alone ({a.slots} slots)", alone, t_alone)
    row(f"A 10x + B, fair share ({a.slots} slots)", fair, t_fair)
    row("A 10x + B, first come first served", fcfs, t_fcfs)
    b_alone = _pct(alone["b"].ttft, 0.99)
    x = _pct(fair["b"].ttft, 0.99) / b_alone
    y = fair["a"].tokens / max(fair["b"].tokens, 1)
    z = ((fair["a"].tokens + fair["b"].tokens) / t_fair) / ((fcfs["a"].tokens + fcfs["b"].tokens) / t_fcfs)
    w = _pct(fcfs["b"].ttft, 0.99) / b_alone
    share = a.slots * KEYS["b"][1] / (KEYS["a"][1] + KEYS["b"][1])
    print(f"\nB's {a.b_clients} closed-loop clients ask for up to {a.b_clients} slots; its share at these weights is "
          f"{share:.1f} of {a.slots}, so B waits for its turn part of the time and A:B is above 4 whenever B has "
          f"nothing waiting (an idle tenant's share goes to the others). On this 2-core machine the mesh's own CPU "
          f"is part of every TTFT: compare the runs, not the figures with other machines.")
    print(f"fairshare: b_p99_over_alone={x:.2f} served_ratio={y:.2f} throughput_over_fcfs={z:.2f} "
          f"b_p99_fcfs_over_alone={w:.2f}")


if __name__ == "__main__":
    main()

"""Weighted fair share under saturation, measured through a real mesh (one mocker worker, the preprocessor's
``--fair-share-slots``), with keys weighted A:B = 4:1 and closed-loop clients streaming completions through the
gateway (httpx). Two shapes, because the issue's goals need different ones:

- *latency*: B's demand is below its share (1 client: at most 1 slot of its 2 of 10); A runs 20x B's clients. B's
  TTFT beside A is compared with B alone, with first come first served, and with B first (A's key ``batch``: the
  best any order of the slots can give B, so what remains is the worker's and the machine's, not the scheduler's).
- *backlog*: both tenants want more than their share (A 20 clients, B 4): the served-token ratio shows the weights;
  throughput is compared with first come, first served in the same shape, and with the slots at the worker's batch
  (8), where a freed batch slot stays empty for a step while the next granted request travels to the worker.

Per run: B's TTFT p50/p99, A's p99, tokens served per tenant, tokens/s. Last line:
``fairshare: b_p99_over_alone=X b_p99_over_b_first=V b_p99_fcfs_over_alone=W served_ratio=Y
throughput_over_fcfs=Z throughput_slots_at_batch_over_fcfs=Z8`` (X, V, W from the latency shape; Y from the backlog
shape; Z the lower of both shapes'; Z8 the backlog shape's with 8 slots).

    python bench/bench_fairshare.py [--quick] [--seconds S] [--slots N] [--b-clients N] [--backlog A,B]
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


def _keys(a_priority: str) -> Path:
    keys = Path(tempfile.mkdtemp(prefix="embedmesh-fair-")) / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"key": k, "tenant": f"tenant-{n}", "weight": w, "priority": a_priority if n == "a" else "interactive"}
        for n, (k, w) in KEYS.items()]}))
    return keys


def _scenario(keys: Path, slots: int, concurrency: dict[str, int], seconds: float) -> tuple[dict[str, Tenant], float]:
    mesh = start_mesh(engine="mocker", workers=1, env={
        "EMBEDMESH_API_KEYS_FILE": str(keys), "EMBEDMESH_PREPROCESSOR_FAIR_SHARE_SLOTS": str(slots),
        "EMBEDMESH_WORKER_MOCKER_DECODE_MS": "20", "EMBEDMESH_TRACE_CONSOLE": "0"})
    try:
        asyncio.run(_drive(mesh.base_url, {"b": 1}, 1.0))  # warm-up
        return asyncio.run(_drive(mesh.base_url, concurrency, seconds))
    finally:
        mesh.stop()


def _tokens_per_s(run: tuple[dict[str, Tenant], float]) -> float:
    tenants, elapsed = run
    return sum(t.tokens for t in tenants.values()) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--seconds", type=float, default=0.0, help="length of each run (default 8, --quick 4)")
    ap.add_argument("--slots", type=int, default=10, help="--fair-share-slots of the fair runs (the worker's batch "
                    "is 8: two more keep it full while a granted request travels to the worker)")
    ap.add_argument("--b-clients", type=int, default=1, help="latency shape: B's closed-loop clients (A gets 20x)")
    ap.add_argument("--backlog", default="20,4", help="backlog shape: A's and B's closed-loop clients")
    a = ap.parse_args()
    seconds = a.seconds or (4.0 if a.quick else 8.0)
    fair_keys, b_first_keys = _keys("interactive"), _keys("batch")
    latency = {"a": 20 * a.b_clients, "b": a.b_clients}
    na, nb = (int(x) for x in a.backlog.split(","))
    backlog = {"a": na, "b": nb}
    print(f"fair share: 1 mocker worker (20 ms decode steps, batch 8), {MAX_TOKENS}-token streamed completions, "
          f"weights A:B = {KEYS['a'][1]}:{KEYS['b'][1]}, --fair-share-slots {a.slots}, {seconds:g} s per run",
          flush=True)
    runs: dict[str, tuple[dict[str, Tenant], float]] = {}
    plan = [
        (f"B alone ({a.b_clients} client)", fair_keys, a.slots, {"b": a.b_clients}),
        (f"latency: A {latency['a']} + B {a.b_clients}, fair share", fair_keys, a.slots, latency),
        (f"latency: A {latency['a']} + B {a.b_clients}, B first (A batch)", b_first_keys, a.slots, latency),
        (f"latency: A {latency['a']} + B {a.b_clients}, first come first served", fair_keys, 0, latency),
        (f"backlog: A {na} + B {nb}, fair share", fair_keys, a.slots, backlog),
        (f"backlog: A {na} + B {nb}, first come first served", fair_keys, 0, backlog),
        (f"backlog: A {na} + B {nb}, fair share, slots = batch (8)", fair_keys, 8, backlog),
    ]
    for name, keys, slots, concurrency in plan:
        print(f"... {name}", flush=True)
        runs[name] = _scenario(keys, slots, concurrency, seconds)

    print("\n| run | B TTFT p50 ms | B TTFT p99 ms | B requests | A TTFT p99 ms | A tokens | B tokens | A:B | "
          "tokens/s | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (t, elapsed) in runs.items():
        b, aa = t["b"], t.get("a", Tenant())
        ratio = aa.tokens / b.tokens if b.tokens and aa.tokens else float("nan")
        print(f"| {name} | {_pct(b.ttft, 0.5) * 1e3:.0f} | {_pct(b.ttft, 0.99) * 1e3:.0f} | {len(b.ttft)} | "
              f"{_pct(aa.ttft, 0.99) * 1e3:.0f} | {aa.tokens} | {b.tokens} | {ratio:.2f} | "
              f"{(aa.tokens + b.tokens) / elapsed:.0f} | {aa.failed + b.failed} |")
    alone, l_fair, l_first, l_fcfs, k_fair = (runs[p[0]][0] for p in plan[:5])
    b_alone = _pct(alone["b"].ttft, 0.99)
    x = _pct(l_fair["b"].ttft, 0.99) / b_alone
    v = _pct(l_fair["b"].ttft, 0.99) / _pct(l_first["b"].ttft, 0.99)
    w = _pct(l_fcfs["b"].ttft, 0.99) / b_alone
    y = k_fair["a"].tokens / max(k_fair["b"].tokens, 1)
    z = min(_tokens_per_s(runs[plan[1][0]]) / _tokens_per_s(runs[plan[3][0]]),
            _tokens_per_s(runs[plan[4][0]]) / _tokens_per_s(runs[plan[5][0]]))
    share = a.slots * KEYS["b"][1] / (KEYS["a"][1] + KEYS["b"][1])
    print(f"\nB's share at these weights is {share:.1f} of {a.slots} slots. Latency shape: B asks for at most "
          f"{a.b_clients} slot(s), under its share, so it gets the next slot that frees; a tenant that asks for "
          f"more than its share must wait for its turn, which is why B's latency is measured below its share and "
          f"the ratio with both tenants backlogged. B first is the best any order of the slots can do for B: the "
          f"rest of its TTFT under load is the worker's (a slot frees only when a sequence ends; the first token "
          f"waits for the running step) and the machine's (on 2 cores the clients and the mesh share the CPU). "
          f"With the slots at the worker's batch, a batch slot freed stays empty for a step while the next granted "
          f"request travels to the worker: tokens/s falls by about a step in each request's length.")
    z8 = _tokens_per_s(runs[plan[6][0]]) / _tokens_per_s(runs[plan[5][0]])
    print(f"fairshare: b_p99_over_alone={x:.2f} b_p99_over_b_first={v:.2f} b_p99_fcfs_over_alone={w:.2f} "
          f"served_ratio={y:.2f} throughput_over_fcfs={z:.2f} throughput_slots_at_batch_over_fcfs={z8:.2f}")


if __name__ == "__main__":
    main()

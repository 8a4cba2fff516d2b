"""Routing quality by simulation (no model): cache hit rate and modelled time to first token per routing policy.

Fleet: N workers, each a bounded LRU cache of KV blocks (leaves evicted before their prefixes, as paged KV caches
do) and one prefill queue: a request's prefill costs ``OVERHEAD_MS + PREFILL_MS_PER_BLOCK x uncached blocks`` and
waits for the prefills queued before it; it then decodes for ``DECODE_S`` (counted as load while it does).
Workload: shared system prompts, and multi-turn sessions whose every turn extends the previous prompt with the
answer and a new user message; half the sessions carry a document as prompt *embeddings* (float16 rows) after the
system prompt. Block hashes are the mesh's real ones (``embedmesh.core.block_hash``), so text and embeddings prompts
are routed the same way. Arrivals scale with the fleet (same load per worker at every size), and every policy sees
the identical request stream.

Policies: round robin; least loaded (fewest active requests); approximate (KvRouter with the router's own routing
history, TTL'd, as for the hf worker); KV events (KvRouter with the index fed by every worker's stored/removed
events, as for vLLM). The last two run the production KvRouter, Registry and RadixIndexer.

    python bench/router_sim.py [--quick]      # writes docs/img/router_sim.png
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from embedmesh.core.block_hash import block_hashes  # noqa: E402
from embedmesh.services.router.policy import KvRouter  # noqa: E402
from embedmesh.services.router.registry import Registry, WorkerState  # noqa: E402
from embedmesh.services.router.scoring import Weights  # noqa: E402

BLOCK = 16
PREFILL_MS_PER_BLOCK = 6.0
"""~16 tokens of prefill on a small GPU model."""
OVERHEAD_MS = 4.0
DECODE_S = 1.5
CACHE_BLOCKS = 500
"""Per worker: well below the working set of all sessions, well above one session."""
RATE_PER_WORKER = 1.5
"""Requests per second per worker."""
POLICIES = ["round-robin", "least-loaded", "approximate", "kv-events"]
WEIGHTS = Weights(prefill=1.0, decode=4.0)
"""Router weights used by both KV-aware policies: one running request ~ four blocks to prefill."""


@dataclass
class Request:
    t: float
    hashes: list[int]
    tokens: int


def workload(n_workers: int, requests: int, seed: int = 0) -> list[Request]:
    """Sessions arrive as a Poisson process; each has 1-8 turns separated by think time."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    systems = [tuple(rng.randrange(32_000) for _ in range(BLOCK * rng.randint(10, 40))) for _ in range(12)]
    out: list[Request] = []
    t = 0.0
    session_rate = n_workers * RATE_PER_WORKER / 4.5  # mean turns per session = 4.5
    while len(out) < requests:
        t += rng.expovariate(session_rate)
        pieces: list[tuple[int, ...] | np.ndarray] = [rng.choice(systems)]
        if rng.random() < 0.5:
            rows = nrng.standard_normal((BLOCK * rng.randint(4, 16), 32)).astype(np.float16)
            pieces.append(rows)  # a document sent as prompt embeddings
        turn_t = t
        for _ in range(rng.randint(1, 8)):
            pieces.append(tuple(rng.randrange(32_000) for _ in range(rng.randint(20, 120))))  # user message
            tokens = sum(len(p) for p in pieces)
            out.append(Request(turn_t, block_hashes(pieces, BLOCK), tokens))
            pieces.append(tuple(rng.randrange(32_000) for _ in range(rng.randint(30, 200))))  # the answer
            turn_t += DECODE_S + rng.expovariate(1 / 6.0)  # think time
    out.sort(key=lambda r: r.t)
    return out[:requests]


class SimWorker:
    def __init__(self) -> None:
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill_free_at = 0.0
        self.active = 0

    def overlap(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def admit(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Cache a prompt's blocks; returns (newly stored, evicted). LRU order: most recent at the end; touching
        the chain back to front keeps a prefix more recent than its suffix, so leaves go first."""
        stored = [h for h in hashes if h not in self.cache]
        for h in reversed(hashes):
            self.cache[h] = None
            self.cache.move_to_end(h)
        evicted = []
        while len(self.cache) > CACHE_BLOCKS:
            evicted.append(self.cache.popitem(last=False)[0])
        return stored, evicted


def simulate(policy: str, n_workers: int, reqs: list[Request], seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    workers = [SimWorker() for _ in range(n_workers)]
    registry = Registry(stale_seconds=1e9, approx_ttl_seconds=60, approx_max_blocks=CACHE_BLOCKS)
    for i in range(n_workers):
        registry.register(WorkerState(f"w{i}", f"w{i}", "m", BLOCK, "sim", policy == "kv-events"))
    router = KvRouter(registry, WEIGHTS, random.Random(seed))
    done: list[tuple[float, int]] = []
    hits = total = 0
    ttft: list[float] = []
    rr = 0
    for req in reqs:
        while done and done[0][0] <= req.t:
            _, i = heapq.heappop(done)
            workers[i].active -= 1
        if policy == "round-robin":
            w, rr = rr % n_workers, rr + 1
        elif policy == "least-loaded":
            w = min(range(n_workers), key=lambda i: (workers[i].active, rng.random()))
        else:
            for i, sw in enumerate(workers):  # the load heartbeats, exact here
                registry.heartbeat(registry.workers[f"w{i}"], sw.active, 0.0)
            w = int(router.route("m", req.hashes, BLOCK, req.tokens).worker_id[1:])
        sw = workers[w]
        overlap = sw.overlap(req.hashes)
        stored, evicted = sw.admit(req.hashes)
        if policy == "kv-events":  # the worker's events, as its RouterLink would publish them
            registry.index.stored(f"w{w}", 0, stored)
            registry.index.removed(f"w{w}", evicted)
        hits += overlap
        total += len(req.hashes)
        blocks = -(-req.tokens // BLOCK)
        start = max(req.t, sw.prefill_free_at)
        first = start + (OVERHEAD_MS + PREFILL_MS_PER_BLOCK * (blocks - overlap)) / 1000
        sw.prefill_free_at = first
        sw.active += 1
        heapq.heappush(done, (first + DECODE_S, w))
        ttft.append((first - req.t) * 1000)
    ttft.sort()
    return {"hit": hits / max(1, total), "ttft_mean": statistics.fmean(ttft), "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p99": ttft[int(len(ttft) * 0.99)]}


def run(requests: int, sizes: list[int], plot: bool = True) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    streams = {n: workload(n, requests, seed=n) for n in sizes}
    print(f"\nrouting simulation: {requests} requests per fleet, {CACHE_BLOCKS}-block LRU per worker, "
          f"{RATE_PER_WORKER} req/s per worker, weights prefill={WEIGHTS.prefill} decode={WEIGHTS.decode}")
    print(f"  {'policy':<14}{'workers':>8}{'hit rate':>10}{'TTFT mean':>12}{'p50':>10}{'p99':>10}")
    for n in sizes:
        for p in POLICIES:
            r = simulate(p, n, streams[n])
            results[p].append(r)
            print(f"  {p:<14}{n:>8}{r['hit'] * 100:>9.1f}%{r['ttft_mean']:>10.0f}ms{r['ttft_p50']:>8.0f}ms"
                  f"{r['ttft_p99']:>8.0f}ms")
    if plot:
        _plot(sizes, results)
    return results


def _plot(sizes: list[int], results: dict[str, list[dict[str, float]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for p in POLICIES:
        axes[0].plot(sizes, [r["hit"] * 100 for r in results[p]], marker="o", label=p)
        axes[1].plot(sizes, [r["ttft_mean"] for r in results[p]], marker="o", label=p)
        axes[2].plot(sizes, [r["ttft_p99"] for r in results[p]], marker="o", label=p)
    axes[0].set(xlabel="workers", ylabel="prefix cache hit rate (% of blocks)", title="KV cache hits")
    axes[1].set(xlabel="workers", ylabel="ms", title="Modelled TTFT, mean")
    axes[2].set(xlabel="workers", ylabel="ms", title="Modelled TTFT, p99", yscale="log")
    for ax in axes:
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    out = ROOT_DIR / "docs" / "img" / "router_sim.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"  plot: {out.relative_to(ROOT_DIR)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    a = ap.parse_args()
    run(1_500 if a.quick else 6_000, [16, 32, 64])


if __name__ == "__main__":
    main()

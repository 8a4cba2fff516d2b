"""Router benchmarks, printed side by side with their baselines in one run.

1. Indexer: KV block events applied per second and ``find_matches`` p50/p99 with ~1M (worker, block) entries
   across 64 workers; memory per indexed block. Anchor: Dynamo's Rust indexer (~9M block ops/s, lookup p50 ~4 us,
   figures from its own documentation, not measured here).
2. Routing quality by simulation (no model): 16/32/64 workers with bounded LRU block caches and a queueing
   prefill-cost model; a workload of shared system prompts and multi-turn sessions (token and embeddings prompts
   hash alike). Round robin, least loaded, approximate (router-side tracking) and event-driven KV-aware routing:
   cache hit rate and modelled time to first token. Plot: docs/img/router_sim.png.

    python bench/bench_router.py [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
import time
import tracemalloc
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.services.router.indexer import RadixIndexer  # noqa: E402
from embedmesh.services.router.registry import Registry, WorkerState  # noqa: E402
from embedmesh.services.router.scoring import Weights, choose, score  # noqa: E402


def bench_indexer(prompts: int, depth: int = 64, workers: int = 64) -> None:
    rng = random.Random(0)
    chains = [[p * 1_000_003 + i + 1 for i in range(depth)] for p in range(prompts)]
    owners = [rng.sample(range(workers), 1) for _ in range(prompts)]
    idx = RadixIndexer()
    t = time.perf_counter()
    ops = 0
    for chain, ws in zip(chains, owners, strict=True):
        for w in ws:
            # events arrive in batches of 16 blocks, as engines publish them
            for start in range(0, depth, 16):
                idx.stored(f"w{w}", chain[start - 1] if start else 0, chain[start:start + 16])
                ops += 16
    build = time.perf_counter() - t
    lat = []
    for _ in range(5000):
        chain = chains[rng.randrange(prompts)]
        q = chain[: rng.randrange(8, depth + 1)] + [rng.randrange(1 << 62)]
        t = time.perf_counter()
        idx.find_matches(q)
        lat.append(time.perf_counter() - t)
    lat.sort()
    tracemalloc.start()
    small = RadixIndexer()
    for chain, ws in list(zip(chains, owners, strict=True))[: max(1, 100_000 // depth)]:
        for w in ws:
            small.stored(f"w{w}", 0, chain)
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"\n(1) indexer: {idx.worker_block_count:,} (worker, block) entries over {workers} workers")
    print(f"  {'':28}{'embedmesh (Python)':>20}{'Dynamo (Rust, documented)':>28}")
    print(f"  {'block events applied / s':28}{ops / build:>20,.0f}{'~9,000,000':>28}")
    print(f"  {'find_matches p50':28}{lat[len(lat) // 2] * 1e6:>18.1f}us{'~4 us':>28}")
    print(f"  {'find_matches p99':28}{lat[int(len(lat) * 0.99)] * 1e6:>18.1f}us{'n/a':>28}")
    print(f"  {'memory per indexed block':28}{mem / max(1, small.worker_block_count):>19.0f}B{'n/a':>28}")


class SimWorker:
    def __init__(self, capacity: int) -> None:
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.busy_until = 0.0
        self.queue = 0

    def overlap(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def admit(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Cache the prompt's blocks; returns (stored, evicted)."""
        stored, evicted = [], []
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        return stored, evicted


def workload(rng: random.Random, requests: int) -> list[list[int]]:
    """Shared system prompts (16 blocks) + multi-turn sessions that extend their own previous prompt."""
    systems = [[s * 7919 + i + 1 for i in range(16)] for s in range(8)]
    sessions: list[list[int]] = []
    out = []
    fresh = itertools.count(10**9)
    for _ in range(requests):
        if sessions and rng.random() < 0.6:
            s = rng.randrange(len(sessions))
            sessions[s] = sessions[s] + [next(fresh) for _ in range(rng.randint(2, 6))]
            out.append(sessions[s])
        else:
            prompt = rng.choice(systems) + [next(fresh) for _ in range(rng.randint(2, 8))]
            sessions.append(prompt)
            if len(sessions) > 200:
                sessions.pop(0)
            out.append(prompt)
    # Chain the hashes as the mesh does: a block's identity is its whole prefix.
    chained = []
    for p in out:
        h, chain = 0, []
        for b in p:
            h = hash((h, b)) & ((1 << 62) - 1)
            chain.append(h)
        chained.append(chain)
    return chained


def simulate(policy: str, n_workers: int, prompts: list[list[int]], rng: random.Random) -> tuple[float, float]:
    workers = [SimWorker(capacity=120) for _ in range(n_workers)]
    registry = Registry(stale_seconds=1e9, approx_ttl_seconds=1e9)
    for i in range(n_workers):
        registry.register(WorkerState(f"w{i}", "", "m", 16, "sim", policy == "kv-events"))
    weights = Weights(prefill=1.0, decode=4.0)
    rr = itertools.count()
    t = 0.0
    hits = total = 0
    ttft = []
    prefill_ms, decode_ms = 2.0, 60.0
    done: list[tuple[float, int]] = []
    for prompt in prompts:
        t += rng.expovariate(n_workers / 25.0)  # arrivals scale with the fleet: ~40% utilisation
        while done and done[0][0] <= t:
            _, w = heapq.heappop(done)
            workers[w].queue -= 1
            registry.workers[f"w{w}"].active_requests = workers[w].queue
        if policy == "round-robin":
            w = next(rr) % n_workers
        elif policy == "least-loaded":
            w = min(range(n_workers), key=lambda i: (workers[i].queue, rng.random()))
        else:
            for i in range(n_workers):
                registry.workers[f"w{i}"].routed_since_load = 0
            overlaps = registry.index.find_matches(prompt)
            scored = score(len(prompt), overlaps, {f"w{i}": workers[i].queue for i in range(n_workers)}, weights)
            w = int(choose(scored, weights, rng).worker_id[1:])
            registry.record_routed(f"w{w}", prompt)
        worker = workers[w]
        overlap = worker.overlap(prompt)
        stored, evicted = worker.admit(prompt)
        if policy == "kv-events":
            registry.index.stored(f"w{w}", 0, prompt)
            registry.index.removed(f"w{w}", evicted)
        hits += overlap
        total += len(prompt)
        start = max(t, worker.busy_until)
        first = start + (len(prompt) - overlap) * prefill_ms / 1000
        worker.busy_until = first + decode_ms / 1000
        worker.queue += 1
        heapq.heappush(done, (worker.busy_until, w))
        ttft.append(first - t)
    return hits / total, statistics.mean(ttft) * 1000


def bench_sim(requests: int) -> None:
    policies = ["round-robin", "least-loaded", "approximate", "kv-events"]
    sizes = [16, 32, 64]
    results: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
    print(f"\n(2) routing simulation: {requests} requests, LRU caches of 120 blocks per worker")
    print(f"  {'policy':<14}" + "".join(f"{f'{n} workers: hit / TTFT':>30}" for n in sizes))
    for p in policies:
        for n in sizes:
            prompts = workload(random.Random(n), requests)
            results[p].append(simulate(p, n, prompts, random.Random(1)))
        print(f"  {p:<14}" + "".join(f"{h * 100:>20.1f}% {ms:>6.1f} ms" for h, ms in results[p]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for p in policies:
            ax1.plot(sizes, [h * 100 for h, _ in results[p]], marker="o", label=p)
            ax2.plot(sizes, [ms for _, ms in results[p]], marker="o", label=p)
        ax1.set(xlabel="workers", ylabel="KV cache hit rate (%)", title="Prefix cache hit rate")
        ax2.set(xlabel="workers", ylabel="mean modelled TTFT (ms)", title="Time to first token")
        ax1.legend()
        fig.tight_layout()
        out = Path(__file__).resolve().parents[1] / "docs" / "img" / "router_sim.png"
        fig.savefig(out, dpi=100)
        print(f"  plot: {out.relative_to(out.parents[2])}")
    except ImportError:
        print("  (matplotlib not installed: no plot)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    bench_indexer(prompts=2_000 if a.quick else 16_000)
    bench_sim(2_000 if a.quick else 8_000)


if __name__ == "__main__":
    main()

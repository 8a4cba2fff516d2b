"""Router benchmarks, printed side by side with their baselines in one run.

1. Indexer (``RadixIndexer``): KV block events applied per second (stored, then removed), ``find_matches`` p50/p99
   with ~1M (worker, block) entries across 64 workers, and memory per indexed block (tracemalloc, on a 100k-entry
   copy because tracing slows building 5x). Anchor: Dynamo's Rust indexer, ~9M block ops/s and lookup p50 ~4 us —
   figures from its own documentation, not measured here.
2. Routing quality by simulation (``bench/router_sim.py``): hit rate and modelled TTFT for round robin, least
   loaded, approximate and event-driven KV-aware routing; plot in docs/img/router_sim.png.

    python bench/bench_router.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_sim  # noqa: E402

from embedmesh.services.router.indexer import RadixIndexer  # noqa: E402

DEPTH = 64
"""Blocks per prompt chain (1024 tokens at block size 16)."""
BATCH = 16
"""Blocks per stored event, as engines publish them."""


def _chains(entries: int, workers: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    """(worker, chain) pairs: 32 shared system prompts of 8 blocks, then per-prompt blocks; each chain on 1 worker,
    every 4th on a second one too (replicated hot prompts)."""
    systems = [[rng.getrandbits(63) | 1 for _ in range(8)] for _ in range(32)]
    out: list[tuple[str, list[int]]] = []
    n = 0
    while n < entries:
        chain = rng.choice(systems) + [rng.getrandbits(63) | 1 for _ in range(DEPTH - 8)]
        owners = rng.sample(range(workers), 2 if len(out) % 4 == 0 else 1)
        for w in owners:
            out.append((f"w{w}", chain))
            n += DEPTH
    return out


def _build(idx: RadixIndexer, pairs: list[tuple[str, list[int]]]) -> int:
    ops = 0
    for w, chain in pairs:
        for s in range(0, DEPTH, BATCH):
            idx.stored(w, chain[s - 1] if s else 0, chain[s:s + BATCH])
            ops += BATCH
    return ops


def bench_indexer(entries: int, workers: int = 64) -> None:
    rng = random.Random(0)
    pairs = _chains(entries, workers, rng)
    idx = RadixIndexer()
    gc.disable()  # measure the index, not the collector's passes over a growing heap
    t = time.perf_counter()
    ops = _build(idx, pairs)
    stored_rate = ops / (time.perf_counter() - t)
    # Lookups: a cached prompt that diverges somewhere (hit), and an unknown prompt (miss, early exit).
    hit, miss = [], []
    for _ in range(20_000):
        _, chain = pairs[rng.randrange(len(pairs))]
        q = chain[: rng.randrange(8, DEPTH + 1)] + [rng.getrandbits(63) | 1 for _ in range(8)]
        t = time.perf_counter()
        idx.find_matches(q)
        hit.append(time.perf_counter() - t)
        q = [rng.getrandbits(63) | 1 for _ in range(DEPTH)]
        t = time.perf_counter()
        idx.find_matches(q)
        miss.append(time.perf_counter() - t)
    hit.sort()
    miss.sort()
    # Removals: evict the second half of a quarter of the chains, in event-sized batches.
    victims = pairs[: len(pairs) // 4]
    t = time.perf_counter()
    rops = 0
    for w, chain in victims:
        for s in range(DEPTH // 2, DEPTH, BATCH):
            idx.removed(w, chain[s:s + BATCH])
            rops += BATCH
    removed_rate = rops / (time.perf_counter() - t)
    gc.enable()
    entries_built, nodes = ops, len({h for _, c in pairs for h in c})

    small_pairs = pairs[: max(1, 100_000 // DEPTH)]
    gc.collect()
    tracemalloc.start()
    small = RadixIndexer()
    _build(small, small_pairs)
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    def us(x: float) -> str:
        return f"{x * 1e6:.1f} us"

    print(f"\nindexer: {entries_built:,} (worker, block) entries, {nodes:,} distinct blocks, {workers} workers, "
          f"chains of {DEPTH} blocks, events of {BATCH} blocks")
    print(f"  {'':34}{'embedmesh (Python)':>20}{'Dynamo (Rust, documented)':>28}")
    print(f"  {'stored events: blocks / s':34}{stored_rate:>20,.0f}{'~9,000,000 ops/s':>28}")
    print(f"  {'removed events: blocks / s':34}{removed_rate:>20,.0f}{'':>28}")
    print(f"  {'find_matches p50 (hit, <=72 blk)':34}{us(hit[len(hit) // 2]):>20}{'~4 us':>28}")
    print(f"  {'find_matches p99 (hit)':34}{us(hit[int(len(hit) * 0.99)]):>20}{'n/a':>28}")
    misses = f"{us(miss[len(miss) // 2])} / {us(miss[int(len(miss) * 0.99)])}"
    print(f"  {'find_matches p50 / p99 (miss)':34}{misses:>20}{'n/a':>28}")
    print(f"  {'memory per (worker, block) entry':34}{mem / max(1, small.worker_block_count):>18.0f} B{'n/a':>28}")
    print(f"  {'memory per distinct block':34}{mem / max(1, small.node_count):>18.0f} B{'n/a':>28}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k entries and a short simulation")
    a = ap.parse_args()
    bench_indexer(100_000 if a.quick else 1_000_000)
    router_sim.run(1_500 if a.quick else 6_000, [16, 32, 64])


if __name__ == "__main__":
    main()

"""KV-aware routing measured end to end on a fleet of mocker workers on one machine (``--engine mocker``: no model,
a simulated paged KV cache that publishes KV events, prefill time from the uncached positions): the same
shared-prefix workload (token-id prompts: ``groups`` prefixes, each request a prefix plus its own suffix, sent in
two seeded waves — the first request of every group, then the rest) through the router in KV-aware, round-robin
and random mode, each on a fresh fleet; then KV-aware with 3 router replicas, and the same after one replica is
SIGKILLed. The client is the project's own light driver (``tests/support/fleet.py``: streamed completions through
the gateway, httpx, ``--concurrency`` at a time). Hit rate is read from the workers (cached / prompt positions).

The oracle is computed offline from the trace and the cache sizes: every group's prefix is computed once and found
by every later request of that group (the caches hold every group when groups are spread evenly: checked below), so
its hit rate is the most any placement can reach on this trace; it has no timings.

Last line: ``fleet: rr_over_kv_ttft_p90=X hit_over_oracle=Y replicas3_over_1=Z after_router_kill_drop=W`` with
X = round robin's TTFT p90 over KV-aware's (every request of the run), Y = KV-aware's hit rate over the oracle's,
Z = the hit rate with 3 router replicas over 1, W = the fraction of the 3-replica hit rate lost in the workload run
right after one replica was killed.

    python bench/bench_fleet.py [--quick] [--workers N] [--concurrency N]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.fleet import (  # noqa: E402
    MOCKER_ENV,
    Result,
    Workload,
    drive,
    hit_rate,
    percentile,
    start_fleet,
    wait_registered,
    worker_counters,
)
from tests.support.load import child_pid  # noqa: E402

BLOCK = 16


def oracle_hit(w: Workload) -> float:
    """Hit rate when each group's prefix is computed once and reused by every later request of the group."""
    cached = (w.per_group - 1) * (w.prefix_tokens // BLOCK * BLOCK)
    return cached / (w.per_group * (w.prefix_tokens + w.suffix_tokens))


class Run:
    """One workload pass through a fleet: the results of both waves, the hit rate, the wall time."""

    def __init__(self, mesh: object, workers: int, w: Workload, salt: int, concurrency: int) -> None:
        first, rest = w.waves(salt)
        before = worker_counters(mesh, workers)  # type: ignore[arg-type]
        t0 = time.monotonic()
        base = mesh.base_url  # type: ignore[attr-defined]
        self.results: list[Result] = drive(base, "mocker", first, w.max_tokens, concurrency)
        time.sleep(0.5)  # the first wave's KV events reach the routers
        self.results += drive(base, "mocker", rest, w.max_tokens, concurrency)
        self.seconds = time.monotonic() - t0
        self.hit = hit_rate(before, worker_counters(mesh, workers))  # type: ignore[arg-type]
        self.failed = sum(not r.ok for r in self.results)

    def ttft(self, q: float) -> float:
        return percentile([r.ttft for r in self.results if r.ok], q)

    @property
    def tokens_per_second(self) -> float:
        return sum(r.tokens for r in self.results) / self.seconds

    def row(self, name: str) -> str:
        return (f"| {name} | {len(self.results)} | {self.failed} | {self.ttft(.5):.3f} | {self.ttft(.9):.3f} | "
                f"{self.tokens_per_second:.0f} | {self.hit:.3f} |")


def fleet_run(workers: int, mode: str, w: Workload, concurrency: int, env: dict[str, str], replicas: int = 1,
              kill_one: bool = False) -> list[Run]:
    mesh = start_fleet(workers, mode, replicas, env)
    try:
        for r in mesh.extra["routers"]:  # type: ignore[attr-defined]
            wait_registered(str(r), workers)
        runs = [Run(mesh, workers, w, 0, concurrency)]
        if kill_one:
            os.kill(child_pid(mesh, "router-1"), signal.SIGKILL)
            runs.append(Run(mesh, workers, w, 1, concurrency))
        return runs
    finally:
        mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 workers, 12 groups x 12 (the default: 32 workers, 48 groups x 8)")
    ap.add_argument("--workers", type=int, default=0, help="mocker workers (default 8 with --quick, else 32)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--prefill-ms", type=float, default=4.0,
                    help="simulated prefill per uncached position: large enough that the workers, not the gateway "
                         "and preprocessor on this machine's cores, bound time to first token")
    a = ap.parse_args()
    workers = a.workers or (8 if a.quick else 32)
    w = Workload(groups=12 if a.quick else 48, per_group=12 if a.quick else 8, prefix_tokens=512, suffix_tokens=32,
                 max_tokens=8)
    env = {"EMBEDMESH_WORKER_MOCKER_PREFILL_MS_PER_TOKEN": str(a.prefill_ms)}
    blocks = int(MOCKER_ENV["EMBEDMESH_WORKER_MOCKER_NUM_BLOCKS"])
    prefix_blocks = w.prefix_tokens // BLOCK
    per_worker = -(-w.groups // workers)
    print(f"fleet: {workers} mocker workers (separate processes), 1 preprocessor, gateway; cache {blocks} blocks of "
          f"{BLOCK} per worker; prefill {a.prefill_ms} ms per uncached "
          f"position; workload {w.groups} groups x {w.per_group} requests, {w.prefix_tokens}-token shared prefix + "
          f"{w.suffix_tokens}-token suffix, {w.max_tokens} tokens out, {a.concurrency} in flight; "
          f"os.cpu_count()={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    print(f"oracle feasible: {per_worker} group prefix(es) of {prefix_blocks} blocks per worker fit "
          f"{blocks} blocks beside a running request: {per_worker * prefix_blocks + 40 <= blocks}")
    runs = {}
    for mode in ("kv", "round-robin", "random"):
        print(f"... {mode}", flush=True)
        runs[mode] = fleet_run(workers, mode, w, a.concurrency, env)[0]
    print("... kv with 3 router replicas, then one killed", flush=True)
    three, killed = fleet_run(workers, "kv", w, a.concurrency, env, replicas=3, kill_one=True)
    oracle = oracle_hit(w)
    print("\n| routing | requests | failed | TTFT p50 s | TTFT p90 s | output tok/s | prefix hit rate |")
    print("|---|---|---|---|---|---|---|")
    for mode, run in runs.items():
        print(run.row(f"{mode} (1 router)"))
    print(three.row("kv, 3 router replicas"))
    print(killed.row("kv, 3 replicas, one SIGKILLed before this run"))
    print(f"| oracle (offline, trace + cache sizes) | {w.groups * w.per_group} | - | - | - | - | {oracle:.3f} |")
    x = runs["round-robin"].ttft(.9) / runs["kv"].ttft(.9)
    y = runs["kv"].hit / oracle
    z = three.hit / runs["kv"].hit if runs["kv"].hit else float("nan")
    drop = max(0.0, (three.hit - killed.hit) / three.hit) if three.hit else float("nan")
    print(f"\nTTFT counts every request of a run (the first wave is cold under every policy); the after-kill figure "
          f"is the whole workload run right after the SIGKILL (~{killed.seconds:.0f} s), not a 30 s window.")
    print(f"fleet: rr_over_kv_ttft_p90={x:.2f} hit_over_oracle={y:.3f} replicas3_over_1={z:.3f} "
          f"after_router_kill_drop={drop:.3f}")


if __name__ == "__main__":
    main()

"""KV-aware routing measured end to end on a fleet of mocker workers on one machine (``--engine mocker``: no model,
a simulated paged KV cache that publishes KV events, prefill time from the uncached positions): the same
shared-prefix workload (token-id prompts: ``groups`` prefixes, each request a prefix plus its own suffix, sent in
two seeded waves — the first request of every group, then the rest) through the router in KV-aware, round-robin
and random mode, each on a fresh fleet; then KV-aware with 3 router replicas, and the same after one replica is
SIGKILLed. The KV-aware / round-robin / random comparison is replayed by aiperf (NVIDIA's benchmark client, 0.13.0
in a venv of its own: ``make aiperf-venv``, ``--aiperf``) as a ``mooncake_trace`` generated here, open loop at
``--rate`` requests/s, when that venv exists; otherwise, and for the replica runs, by the project's own light driver
(``tests/support/fleet.py``: streamed completions through the gateway, httpx, ``--concurrency`` at a time). Hit
rate is read from the workers (cached / prompt positions).

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
CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
AIPERF_VENV = CACHE / "venvs" / "aiperf-0.13.0"


def oracle_hit(w: Workload) -> float:
    """Hit rate when each group's prefix is computed once and reused by every later request of the group."""
    cached = (w.per_group - 1) * (w.prefix_tokens // BLOCK * BLOCK)
    return cached / (w.per_group * (w.prefix_tokens + w.suffix_tokens))


AIPERF_BLOCK = 64
"""Positions per hash id in the aiperf trace (``--isl-block-size``); the prefix is a whole number of them."""


def mooncake_trace(w: Workload, path: Path, rate: float, salt: int = 0) -> int:
    """The workload as aiperf's ``mooncake_trace`` JSONL (no downloads): each group's prefix is the same hash ids,
    each request one more id of its own for the suffix; the first wave at ``rate`` per second, a 2 s pause, the
    rest at ``rate``, in the seeded order of ``Workload.waves``. Returns the number of requests."""
    import json
    import random

    rng = random.Random(f"{w.seed}:{salt}")
    per_prefix = w.prefix_tokens // AIPERF_BLOCK
    first = [(g, 0) for g in range(w.groups)]
    rest = [(g, i) for g in range(w.groups) for i in range(1, w.per_group)]
    rng.shuffle(first)
    rng.shuffle(rest)
    lines = []
    for k, (g, i) in enumerate(first + rest):
        ids = [1 + g * per_prefix + j for j in range(per_prefix)] + [1_000_000 + salt * 100_000 + g * 1000 + i]
        at = k * 1000 / rate + (2000 if k >= len(first) else 0)
        lines.append(json.dumps({"timestamp": round(at), "input_length": w.prefix_tokens + w.suffix_tokens,
                                 "output_length": w.max_tokens, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def hf_cache_with_tokenizer(root: Path) -> str:
    """A Hugging Face cache under ``root`` holding the default model's tokenizer as repo ``embedmesh/tokenizer``,
    so aiperf (whose tokenizer workers force offline mode, where a plain folder path is not accepted) finds it
    without the network. Returns the repo id."""
    import shutil

    from embedmesh.models.convert import ensure_default_model

    repo = root / "models--embedmesh--tokenizer"
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(ensure_default_model() / name, snap / name)
    return "embedmesh/tokenizer"


class AiperfRun:
    """One aiperf ``profile`` replay of the trace through a fleet's gateway: its TTFT, output tokens/s and errors,
    and the hit rate read from the workers around it."""

    def __init__(self, mesh: object, workers: int, w: Workload, venv: Path, rate: float, work: Path) -> None:
        import json
        import subprocess

        cache = work / "hf" / "hub"
        tokenizer = hf_cache_with_tokenizer(cache)
        trace = work / "trace.jsonl"
        self.requests = mooncake_trace(w, trace, rate)
        out = work / "aiperf"
        before = worker_counters(mesh, workers)  # type: ignore[arg-type]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
        cmd = [str(venv / "bin" / "aiperf"), "profile", "-m", "mocker", "--url", mesh.base_url,  # type: ignore[attr-defined]
               "--endpoint-type", "completions", "--streaming", "--input-file", str(trace),
               "--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--isl-block-size", str(AIPERF_BLOCK),
               "--tokenizer", tokenizer, "--use-server-token-count", "--artifact-dir", str(out), "--ui-type", "none"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
        self.hit = hit_rate(before, worker_counters(mesh, workers))  # type: ignore[arg-type]
        d = json.loads((out / "profile_export_aiperf.json").read_text())
        ttft = d["time_to_first_token"]
        self.p50, self.p90 = ttft["p50"] / 1000, ttft["p90"] / 1000
        self.tokens_per_second = d["output_token_throughput"]["avg"]
        self.failed = int((d.get("error_request_count") or {}).get("avg", 0))
        self.completed = int(d["request_count"]["avg"])

    def ttft(self, q: float) -> float:
        return self.p50 if q == .5 else self.p90

    def row(self, name: str) -> str:
        return (f"| {name} | {self.requests} | {self.failed + self.requests - self.completed} | {self.p50:.3f} | "
                f"{self.p90:.3f} | {self.tokens_per_second:.0f} | {self.hit:.3f} |")


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
              kill_one: bool = False, aiperf: tuple[Path, float] | None = None) -> list[Run | AiperfRun]:
    mesh = start_fleet(workers, mode, replicas, env)
    try:
        for r in mesh.extra["routers"]:  # type: ignore[attr-defined]
            wait_registered(str(r), workers)
        if aiperf is not None:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="embedmesh-aiperf-") as work:
                return [AiperfRun(mesh, workers, w, aiperf[0], aiperf[1], Path(work))]
        runs: list[Run | AiperfRun] = [Run(mesh, workers, w, 0, concurrency)]
        if kill_one:
            os.kill(child_pid(mesh, "router-1"), signal.SIGKILL)
            runs.append(Run(mesh, workers, w, 1, concurrency))
        return runs
    finally:
        mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 workers, 12 groups x 12 (the default: 32 workers, 48 groups x 16)")
    ap.add_argument("--workers", type=int, default=0, help="mocker workers (default 8 with --quick, else 32)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--prefill-ms", type=float, default=4.0,
                    help="simulated prefill per uncached position: large enough that the workers, not the gateway "
                         "and preprocessor on this machine's cores, bound time to first token")
    ap.add_argument("--aiperf", default=str(AIPERF_VENV),
                    help="venv with aiperf==0.13.0 (make aiperf-venv builds it): when it exists, "
                         "aiperf replays the workload as a mooncake trace for the KV-aware / round-robin / random "
                         "comparison; otherwise the light driver does")
    ap.add_argument("--rate", type=float, default=4.0, help="aiperf: requests per second of the trace")
    a = ap.parse_args()
    venv = Path(a.aiperf)
    aiperf = (venv, a.rate) if (venv / "bin" / "aiperf").exists() else None
    workers = a.workers or (8 if a.quick else 32)
    # Each group's first request is cold under every policy; TTFT p90 compares the policies only while those cold
    # firsts are under a tenth of the run: 1/12 with --quick, 1/16 by default (at 1/8, p90 was a cold prefill for all).
    w = Workload(groups=12 if a.quick else 48, per_group=12 if a.quick else 16, prefix_tokens=512, suffix_tokens=32,
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
        runs[mode] = fleet_run(workers, mode, w, a.concurrency, env, aiperf=aiperf)[0]
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
    driver = (f"aiperf 0.13.0 (mooncake_trace, fixed schedule at {a.rate:g} requests/s)" if aiperf else
              f"the light driver ({a.concurrency} in flight; no aiperf venv at {venv}: make aiperf-venv)")
    print(f"\nThe KV-aware / round-robin / random rows: {driver}; the replica rows: the light driver.")
    print(f"TTFT counts every request of a run (the first wave is cold under every policy); the after-kill figure "
          f"is the whole workload run right after the SIGKILL (~{killed.seconds:.0f} s), not a 30 s window.")
    print(f"fleet: rr_over_kv_ttft_p90={x:.2f} hit_over_oracle={y:.3f} replicas3_over_1={z:.3f} "
          f"after_router_kill_drop={drop:.3f}")


if __name__ == "__main__":
    main()

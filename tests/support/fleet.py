"""A fleet of mocker workers on one machine and a shared-prefix workload to drive through it: what
``tests/e2e/test_fleet.py`` checks and ``bench/bench_fleet.py`` measures.

The workload is token-id prompts (no tokenizer in the way): ``groups`` shared prefixes of ``prefix_tokens`` each,
every request one prefix plus its own suffix. It is sent in two waves, each in a seeded random order: the first
request of every group, then the rest, so a KV-aware router has seen each prefix's events once before the
requests that can reuse it (a round-robin order aligned with the groups would fake affinity, hence the shuffle).

Hit rate is read from the workers themselves (the mocker's ``embedmesh_mocker_cached_tokens`` /
``embedmesh_mocker_prompt_tokens`` on each worker's metrics port), never from the router's belief.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tests.support.mesh import Mesh

__all__ = ["Workload", "Result", "drive", "start_fleet", "wait_registered", "worker_counters", "hit_rate",
           "percentile", "MOCKER_ENV"]

MOCKER_ENV = {
    "EMBEDMESH_WORKER_MOCKER_NUM_BLOCKS": "160",
    "EMBEDMESH_WORKER_MOCKER_MAX_CONTEXT_TOKENS": "1024",
    "EMBEDMESH_WORKER_MOCKER_PREFILL_MS_PER_TOKEN": "2",
    "EMBEDMESH_WORKER_MOCKER_DECODE_MS": "2",
    "EMBEDMESH_WORKER_MOCKER_DECODE_MS_PER_SEQ": "0.2",
    "EMBEDMESH_WORKER_MAX_BATCH_SIZE": "16",
}
"""A cache-bound fleet: 160 blocks of 16 positions hold ~3 prefixes of 512 positions besides a running request, so
a worker that sees every group thrashes while one that sees its own groups keeps them. An uncached prompt of 544
positions takes ~1.1 s of simulated prefill, a cached one ~0.06 s: far above the mesh's own overhead on a busy
2-core machine, so time to first token shows the cache too."""


@dataclass(frozen=True)
class Workload:
    groups: int = 12
    prefix_tokens: int = 512
    suffix_tokens: int = 32
    per_group: int = 4
    max_tokens: int = 8
    seed: int = 0

    def waves(self, salt: int = 0) -> tuple[list[list[int]], list[list[int]]]:
        """(first request of each group, the others), each in a seeded random order. ``salt`` makes other
        prefixes (a second run against warm caches must not find the first run's blocks)."""
        rng = random.Random(f"{self.seed}:{salt}")
        prefixes = [[rng.randrange(1, 40000) for _ in range(self.prefix_tokens)] for _ in range(self.groups)]
        prompts = [[p + [rng.randrange(1, 40000) for _ in range(self.suffix_tokens)] for _ in range(self.per_group)]
                   for p in prefixes]
        first = [g[0] for g in prompts]
        rest = [q for g in prompts for q in g[1:]]
        rng.shuffle(first)
        rng.shuffle(rest)
        return first, rest


@dataclass(frozen=True)
class Result:
    ok: bool
    ttft: float
    """Seconds to the first streamed token."""
    total: float
    tokens: int
    error: str = ""


def _one(base_url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    t0 = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    first = 0.0
    tokens = 0
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                return Result(False, 0, time.monotonic() - t0, 0, f"{r.status_code} {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line[6:] == "[DONE]":
                    return Result(tokens == max_tokens, first, time.monotonic() - t0, tokens,
                                  "" if tokens == max_tokens else f"{tokens} tokens")
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, first, time.monotonic() - t0, tokens, str(chunk["error"]))
                text = chunk["choices"][0]["text"] if chunk["choices"] else ""
                if text:
                    if not first:
                        first = time.monotonic() - t0
                    tokens += len(text.split())  # the mocker's tokens read " <id>"; a chunk may carry several
    except httpx.HTTPError as e:
        return Result(False, first, time.monotonic() - t0, tokens, repr(e))
    return Result(False, first, time.monotonic() - t0, tokens, "no [DONE]")


def drive(base_url: str, model: str, prompts: Sequence[list[int]], max_tokens: int, concurrency: int) -> list[Result]:
    """Send ``prompts`` as streamed completions, ``concurrency`` at a time, in order; results in prompt order."""
    results: list[Result | None] = [None] * len(prompts)
    lock = threading.Lock()
    next_i = [0]

    def work() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= len(prompts):
                return
            results[i] = _one(base_url, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def start_fleet(workers: int, mode: str = "kv", replicas: int = 1, env: dict[str, str] | None = None,
                extra_args: list[str] | None = None) -> Mesh:
    """A mesh of ``workers`` mocker workers (separate processes), ``replicas`` routers in ``mode`` on consecutive
    free ports, one preprocessor and the gateway; no embedding worker or vector store."""
    from tests.support.mesh import port_bindable, start_mesh

    args = ["--router-mode", mode, "--router-replicas", str(replicas), "--embed-worker-port", "0",
            "--vector-store-port", "0"]
    if replicas > 1:
        for _ in range(200):
            first = random.randrange(20000, 32000 - replicas)
            if all(port_bindable(first + k) for k in range(replicas)):
                args += ["--router-port", str(first)]
                break
    mesh = start_mesh(workers=workers, engine="mocker", env={**MOCKER_ENV, **(env or {})},
                      extra_args=[*args, *(extra_args or [])], timeout=300)
    if replicas > 1:
        mesh.extra["routers"] = [f"127.0.0.1:{first + k}" for k in range(replicas)]
    else:
        mesh.extra["routers"] = [str(mesh.extra["router"])]
    return mesh


def wait_registered(router: str, count: int, timeout: float = 60) -> None:
    """Until ``router`` lists ``count`` workers."""
    import grpc

    from embedmesh.router.v1 import router_pb2, router_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        while time.monotonic() < deadline:
            try:
                if len(stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers) == count:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"{router} does not list {count} workers")


def worker_counters(mesh: Mesh, workers: int) -> dict[str, float]:
    """Every worker's mocker counters summed (prompt and cached positions, stored and removed blocks)."""
    base = int(str(mesh.extra["metrics_base"])) + 10
    out = {"prompt": 0.0, "cached": 0.0, "stored": 0.0, "removed": 0.0}
    names = {"embedmesh_mocker_prompt_tokens_total": "prompt", "embedmesh_mocker_cached_tokens_total": "cached",
             "embedmesh_mocker_stored_blocks_total": "stored", "embedmesh_mocker_removed_blocks_total": "removed"}
    for i in range(workers):
        with urllib.request.urlopen(f"http://127.0.0.1:{base + i}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in names:
                    out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    """Cached over prompt positions between two readings of ``worker_counters``."""
    prompt = after["prompt"] - before["prompt"]
    return (after["cached"] - before["cached"]) / prompt if prompt else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

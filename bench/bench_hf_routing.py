"""KV-aware routing against round robin on a real mesh of 2 hf workers (the default SmolLM2 model, separate
processes, one torch thread each, the router in ``--router-mode kv`` then ``round-robin``, a fresh mesh for each):
the same workload through the gateway to both — a working set of 3 distinct ~``--tokens``-token text prompts, sent
in rounds, one request at a time (a pause of ``--pause`` s after each, so the worker's KV events reach the router
as they would between a user's turns), streamed completions with ``max_tokens: 1``, so the time to the first SSE
chunk (TTFT) is the prefill. One warm-up round first (cold under both policies), then ``--rounds`` measured rounds.

Each worker's prefix cache (``EMBEDMESH_WORKER_HF_PREFIX_CACHE_BLOCKS``) is sized to hold about 2 of the prompts, not
3: round robin, with an odd working set, sends every prompt to both workers in turn, so each worker sees all 3 in a
cycle and its LRU cache thrashes; KV-aware routing keeps each prompt on the worker that holds it. Hit rates are read
from the workers themselves (``embedmesh_hf_prefix_hit_tokens`` over ``embedmesh_hf_prefix_lookup_tokens`` on each
worker's metrics port), never from the router's belief; the worker that served each request is the one whose
lookups grew.

Last line: ``hf_routing: kv_over_rr_ttft_p50=X kv_hit=Y rr_hit=Z`` (X = KV-aware's TTFT p50 over round robin's,
measured rounds only; Y, Z = the measured rounds' hit rates).

    python bench/bench_hf_routing.py [--quick] [--tokens 1500] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.fleet import percentile, wait_registered  # noqa: E402
from tests.support.mesh import Mesh, start_mesh  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
PROMPTS = 3
WORDS = ("river bridge market harbour castle tower garden street valley mountain forest village school library "
         "station museum theatre church square palace meadow orchard quarry canal mill lighthouse").split()


def make_prompts(count: int, tokens: int) -> list[tuple[str, int]]:
    """``count`` distinct text prompts of about ``tokens`` tokens each (seeded word salad, each opening with its
    own words), with their token counts under the model's tokenizer."""
    from embedmesh.models import ensure_default_model
    from embedmesh.services.preprocessor.prompts import Tokenizer

    tok = Tokenizer(ensure_default_model())
    out = []
    for k in range(count):
        rng = random.Random(k)
        words = [f"Document {k}:"]
        while len(tok.encode(" ".join(words))) < tokens:
            words.extend(rng.choice(WORDS) for _ in range(50))
        text = " ".join(words)
        while len(tok.encode(text)) > tokens:
            text = text.rsplit(" ", 1)[0]
        text += f"\nQuestion {k}: which place is named most often?"
        out.append((text, len(tok.encode(text))))
    return out


def counters(mesh: Mesh) -> list[tuple[float, float]]:
    """(lookup, hit) prompt positions of each worker's prefix cache, from its metrics port."""
    base = int(str(mesh.extra["metrics_base"])) + 10
    out = []
    for i in range(len(mesh.worker_ports)):
        lookup = hit = 0.0
        with urllib.request.urlopen(f"http://127.0.0.1:{base + i}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name == "embedmesh_hf_prefix_lookup_tokens_total":
                    lookup += float(line.rsplit(" ", 1)[1])
                elif name == "embedmesh_hf_prefix_hit_tokens_total":
                    hit += float(line.rsplit(" ", 1)[1])
        out.append((lookup, hit))
    return out


@dataclass(frozen=True)
class Sent:
    prompt: int
    ttft: float
    worker: int
    """Index of the worker whose lookups grew; -1 if none or several did."""
    lookup: float
    hit: float


def send(mesh: Mesh, text: str, timeout: float) -> float:
    """One streamed completion, ``max_tokens: 1``; seconds to the first SSE data chunk (read to the end)."""
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = 0.0
    with httpx.stream("POST", f"{mesh.base_url}/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"completion failed: {r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if not first:
                    first = time.monotonic() - t0
                if '"error"' in line:
                    raise RuntimeError(f"completion failed: {line[:300]}")
    if not first:
        raise RuntimeError("no SSE chunk")
    return first


def run(mode: str, prompts: list[tuple[str, int]], rounds: int, cache_blocks: int, pause: float,
        timeout: float) -> tuple[list[Sent], list[Sent]]:
    """Warm-up round and measured rounds on a fresh 2-worker mesh in ``mode``; the mesh is stopped either way."""
    env = {"EMBEDMESH_WORKER_HF_PREFIX_CACHE_BLOCKS": str(cache_blocks), "EMBEDMESH_WORKER_THREADS": "1"}
    mesh = start_mesh(workers=2, engine="hf", env=env, timeout=600,
                      extra_args=["--router-mode", mode, "--embed-worker-port", "0", "--vector-store-port", "0"])
    try:
        wait_registered(str(mesh.extra["router"]), 2)
        sent: list[Sent] = []
        for _ in range(1 + rounds):
            for k, (text, _) in enumerate(prompts):
                before = counters(mesh)
                ttft = send(mesh, text, timeout)
                time.sleep(pause)
                after = counters(mesh)
                grew = [i for i in range(len(after)) if after[i][0] > before[i][0]]
                lookup = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
                hit = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
                sent.append(Sent(k, ttft, grew[0] if len(grew) == 1 else -1, lookup, hit))
                print(f"  {mode}: prompt {k} -> worker {sent[-1].worker}, TTFT {ttft:.2f} s, "
                      f"{hit:.0f}/{lookup:.0f} positions cached", flush=True)
        return sent[:len(prompts)], sent[len(prompts):]
    finally:
        mesh.stop()


def hit_rate(sent: list[Sent]) -> float:
    lookup = sum(s.lookup for s in sent)
    return sum(s.hit for s in sent) / lookup if lookup else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 measured rounds (the default: 4)")
    ap.add_argument("--tokens", type=int, default=1500, help="tokens per prompt (about)")
    ap.add_argument("--rounds", type=int, default=0, help="measured rounds after the warm-up (default 2 / 4)")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds after each request")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    a = ap.parse_args()
    rounds = a.rounds or (2 if a.quick else 4)
    prompts = make_prompts(PROMPTS, a.tokens)
    blocks_each = max(n for _, n in prompts) // BLOCK
    cache_blocks = 2 * blocks_each + blocks_each // 4  # about 2 prompts, not 3
    print(f"hf routing: 2 hf workers (SmolLM2-135M, separate processes, 1 torch thread each), 1 router, gateway; "
          f"{PROMPTS} prompts of {', '.join(str(n) for _, n in prompts)} tokens, each cache {cache_blocks} blocks of "
          f"{BLOCK} (a prompt fills {blocks_each}); 1 warm-up round + {rounds} measured, sequential, max_tokens 1, "
          f"{a.pause} s pause after each; os.cpu_count()={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    results = {}
    for mode in ("kv", "round-robin"):
        print(f"... {mode}", flush=True)
        results[mode] = run(mode, prompts, rounds, cache_blocks, a.pause, a.timeout)
    print("\n| routing | measured requests | TTFT p50 s | TTFT p90 s | warm-up TTFT p50 s | prefix hit rate | "
          "workers per prompt |")
    print("|---|---|---|---|---|---|---|")
    for mode, (warm, measured) in results.items():
        ttfts = [s.ttft for s in measured]
        spread = max(len({s.worker for s in warm + measured if s.prompt == k}) for k in range(PROMPTS))
        print(f"| {mode} | {len(measured)} | {percentile(ttfts, .5):.3f} | {percentile(ttfts, .9):.3f} | "
              f"{percentile([s.ttft for s in warm], .5):.3f} | {hit_rate(measured):.3f} | {spread} |")
    kv, rr = results["kv"][1], results["round-robin"][1]
    ratio = percentile([s.ttft for s in kv], .5) / percentile([s.ttft for s in rr], .5)
    print(f"\nworkers per prompt: the most distinct workers any one prompt was served by (warm-up included); "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"hf_routing: kv_over_rr_ttft_p50={ratio:.2f} kv_hit={hit_rate(kv):.3f} rr_hit={hit_rate(rr):.3f}")


if __name__ == "__main__":
    main()

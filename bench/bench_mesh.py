"""Mesh benchmarks, each printed side by side with its in-process baseline from the same run.

(a) overhead: a tiny request through gateway -> preprocessor -> worker (echo engine: no model) vs the engine
    called in-process; p50/p99 latency and requests/s at 1 and 32 concurrent clients; also the gRPC entry alone.
(b) ingest: an 8000x576 float32 prompt via REST (base64 torch.save JSON) vs gRPC (raw Tensor bytes): MB/s.
(c) tokens/s on SmolLM2 through the mesh vs the hf engine alone, at 1 and 8 concurrent requests.

    python bench/bench_mesh.py [--only a,b,c] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mesh_generate  # noqa: E402

from tests.support.mesh import start_mesh  # noqa: E402

MODEL_ECHO = "echo"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def row(name: str, lat: list[float], wall: float) -> str:
    return (f"  {name:<34} p50 {pct(lat, 50) * 1e3:8.2f} ms   p99 {pct(lat, 99) * 1e3:8.2f} ms   "
            f"{len(lat) / wall:8.0f} req/s")


async def drive(fn: Any, concurrency: int, total: int) -> tuple[list[float], float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            await fn()
            lat.append(time.perf_counter() - t)

    for _ in range(min(20, total)):  # warm-up
        await fn()
    t0 = time.perf_counter()
    await asyncio.gather(*[one() for _ in range(total)])
    return lat, time.perf_counter() - t0


async def bench_overhead(total: int) -> None:
    import grpc
    import httpx

    from embedmesh.core.sampling import SamplingParams
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment
    from embedmesh.services.worker.engines.echo.engine import EchoEngine

    print("\n(a) mesh overhead: prompt [1,2,3], max_tokens=1, echo engine (no model)")
    engine = EchoEngine()
    counter = iter(range(10**9))

    async def in_process() -> None:
        req = GenerationRequest(f"r{next(counter)}", [TokenSegment((1, 2, 3))], SamplingParams(max_tokens=1))
        async for _ in engine.generate(req):
            pass

    mesh = start_mesh(engine="echo")
    try:
        body = {"model": MODEL_ECHO, "prompt": [1, 2, 3], "max_tokens": 1}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=mesh.base_url, limits=limits, timeout=60) as http, \
                grpc.aio.insecure_channel(mesh.preprocessor) as ch:
            params = inference_pb2.CompletionParams(model=MODEL_ECHO,
                                                    prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
            params.sampling.max_tokens = 1
            greq = mesh_generate.request_bytes(params)
            generate = mesh_generate.one_message(ch)

            async def rest() -> None:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text

            async def grpc_entry() -> None:
                await mesh_generate.whole(generate(greq))

            for c in (1, 32):
                base_lat, base_wall = await drive(in_process, c, total)
                g_lat, g_wall = await drive(grpc_entry, c, total)
                r_lat, r_wall = await drive(rest, c, total)
                print(f" concurrency {c}:")
                print(row("engine in-process (baseline)", base_lat, base_wall))
                print(row("gRPC: preprocessor -> worker", g_lat, g_wall))
                print(row("REST: gateway -> preproc -> worker", r_lat, r_wall))
                print(f"  added latency p50: gRPC {(pct(g_lat, 50) - pct(base_lat, 50)) * 1e3:.2f} ms, "
                      f"REST {(pct(r_lat, 50) - pct(base_lat, 50)) * 1e3:.2f} ms")
    finally:
        mesh.stop()


async def bench_ingest(repeats: int) -> None:
    import grpc
    import httpx
    import torch

    from embedmesh.core.server import channel_options
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2

    rows, hidden = 8000, 576
    arr = np.random.default_rng(0).standard_normal((rows, hidden), dtype=np.float32)
    mb = arr.nbytes / 1e6
    print(f"\n(b) embeddings ingest: {rows}x{hidden} float32 = {mb:.1f} MB per request, max_tokens=1, echo engine")
    buf = io.BytesIO()
    torch.save(torch.from_numpy(arr), buf)
    mesh = start_mesh(engine="echo")
    try:
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=120) as http, \
                grpc.aio.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:

            async def rest() -> None:
                # Client side included: base64 + JSON, as the openai SDK does it.
                import orjson

                b64 = base64.b64encode(buf.getvalue()).decode()
                content = orjson.dumps({"model": MODEL_ECHO, "prompt": "", "max_tokens": 1, "prompt_embeds": b64})
                r = await http.post("/v1/completions", content=content,
                                    headers={"content-type": "application/json"})
                assert r.status_code == 200, r.text

            async def raw() -> None:
                t = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[rows, hidden], data=arr.tobytes())
                params = inference_pb2.CompletionParams(model=MODEL_ECHO,
                                                        prompt_embeds=[inference_pb2.PromptEmbeds(tensor=t)])
                params.sampling.max_tokens = 1
                await mesh_generate.complete(ch, params)

            results = {}
            for name, fn in (("REST base64 torch.save (baseline)", rest), ("gRPC raw Tensor bytes", raw)):
                lat, _ = await drive(fn, 1, repeats)
                results[name] = lat
            base = statistics.median(results["REST base64 torch.save (baseline)"])
            for name, lat in results.items():
                med = statistics.median(lat)
                print(f"  {name:<36} median {med * 1e3:8.1f} ms  p99 {pct(lat, 99) * 1e3:8.1f} ms  "
                      f"{mb / med:8.0f} MB/s   x{base / med:.1f}")
    finally:
        mesh.stop()


async def bench_tokens(max_tokens: int) -> None:
    import grpc

    from embedmesh.core.sampling import SamplingParams
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.models import DEFAULT_MODEL, ensure_default_model
    from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    print(f"\n(c) tokens/s on SmolLM2-135M (hf engine, 2 threads, float32), {max_tokens} tokens per request")
    prompt = (1, 504, 3458, 282, 4649, 314)
    results: dict[tuple[str, int], float] = {}
    engine = HFEngine(HFEngineConfig(ensure_default_model(), DEFAULT_MODEL))
    await engine.start()
    counter = iter(range(10**9))

    async def alone() -> int:
        req = GenerationRequest(f"t{next(counter)}", [TokenSegment(prompt)],
                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        n = 0
        async for d in engine.generate(req):
            n = d.completion_tokens
        return n

    for c in (1, 8):
        await alone()
        t = time.perf_counter()
        counts = await asyncio.gather(*[alone() for _ in range(c)])
        results[("engine alone (baseline)", c)] = sum(counts) / (time.perf_counter() - t)
    await engine.shutdown()

    mesh = start_mesh(engine="hf")
    try:
        async with grpc.aio.insecure_channel(mesh.preprocessor) as ch:

            async def through_mesh() -> int:
                params = inference_pb2.CompletionParams(model=DEFAULT_MODEL,
                                                        prompt_token_ids=[inference_pb2.TokenIds(ids=prompt)])
                params.sampling.max_tokens = max_tokens
                params.sampling.temperature = 0
                params.sampling.ignore_eos = True
                r = await mesh_generate.complete(ch, params)
                return r.usage.completion_tokens

            for c in (1, 8):
                await through_mesh()
                t = time.perf_counter()
                counts = await asyncio.gather(*[through_mesh() for _ in range(c)])
                results[("through the mesh (gRPC)", c)] = sum(counts) / (time.perf_counter() - t)
    finally:
        mesh.stop()
    for c in (1, 8):
        base = results[("engine alone (baseline)", c)]
        for name in ("engine alone (baseline)", "through the mesh (gRPC)"):
            v = results[(name, c)]
            print(f"  concurrency {c}: {name:<26} {v:7.1f} tok/s   x{v / base:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="a,b,c")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    if "a" in parts:
        asyncio.run(bench_overhead(200 if a.quick else 1000))
    if "b" in parts:
        asyncio.run(bench_ingest(5 if a.quick else 15))
    if "c" in parts:
        asyncio.run(bench_tokens(16 if a.quick else 48))


if __name__ == "__main__":
    main()

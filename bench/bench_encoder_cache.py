"""Encoder cache benchmark, in one run on a real redis-server:

- the preprocessor's cost to turn an 8000x576 float32 prompt_embeds payload into rows: cold (base64 decode +
  torch.save decode + validation) vs L1 hit vs L2 hit (both include hashing the payload and validation);
- L2 put/get MB/s for 1 MiB and 16 MiB tensors.

    python bench/bench_encoder_cache.py [--quick]
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.services.encoder_cache.tiered import CacheConfig, CachedTensor, TieredCache  # noqa: E402
from embedmesh.services.preprocessor.embeds import ModelSpec  # noqa: E402
from embedmesh.services.preprocessor.prompts import EmbedsResolver, RawEmbeds  # noqa: E402
from embedmesh.tensor.v1 import tensor_pb2  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402


def timed(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s) * 1e3:8.2f} ms   p99 {s[int(0.99 * (len(s) - 1))] * 1e3:8.2f} ms"


async def prompt_costs(redis_url: str, repeats: int) -> None:
    import pybase64
    import torch

    buf = io.BytesIO()
    torch.save(torch.randn(8000, 576), buf)
    b64 = base64.b64encode(buf.getvalue()).decode()
    spec = ModelSpec(576, 16384, tensor_pb2.DATA_TYPE_FP32)
    print(f"\nprompt_embeds 8000x576 float32 ({len(buf.getvalue()) / 1e6:.1f} MB torch.save, "
          f"{len(b64) / 1e6:.1f} MB base64): payload -> validated rows")
    results: dict[str, list[float]] = {"cold: base64 + decode + validate (baseline)": [], "L1 hit": [], "L2 hit": []}
    for _ in range(repeats):
        for name in results:
            cache = TieredCache(CacheConfig(capacity_bytes=1 << 30, redis_url=redis_url))
            resolve = EmbedsResolver(cache, spec, 1 << 30, 16)
            raw = pybase64.b64decode(b64, validate=True)
            await resolve(RawEmbeds(encoded=raw), "prompt_embeds")  # warm the tiers (and L2) for the hit cases
            if name == "L2 hit":
                cache.l1 = type(cache.l1)(1 << 30)  # a replica that has not seen it: L1 empty, Redis has it
            if name.startswith("cold"):
                await cache.close()
                cache = TieredCache(CacheConfig(capacity_bytes=1 << 30))
                resolve = EmbedsResolver(cache, spec, 1 << 30, 16)
            t = time.perf_counter()
            if name.startswith("cold"):
                raw = pybase64.b64decode(b64, validate=True)
            await resolve(RawEmbeds(encoded=raw), "prompt_embeds")
            results[name].append(time.perf_counter() - t)
            await cache.close()
    base = statistics.median(results["cold: base64 + decode + validate (baseline)"])
    for name, samples in results.items():
        print(f"  {name:<44} {timed(samples)}   x{base / statistics.median(samples):5.1f} cheaper")
    print("  (an upload-once id skips hashing too: see /v1/prompt_embeds)")


async def l2_throughput(redis_url: str, repeats: int) -> None:
    print("\nL2 (Redis, chunked, checksummed) throughput vs L1")
    for mib in (1, 16):
        arr = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 4, dtype=np.float32)
        value = CachedTensor(arr, tensor_pb2.DATA_TYPE_FP32)
        cache = TieredCache(CacheConfig(capacity_bytes=1 << 30, redis_url=redis_url))
        assert cache.l2 is not None
        puts, gets, l1 = [], [], []
        for i in range(repeats):
            t = time.perf_counter()
            await cache.l2.put(f"k{i}", arr, value.dtype, 600)
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = await cache.l2.get(f"k{i}")
            gets.append(time.perf_counter() - t)
            assert got is not None
            cache.l1.put("x", value, value.nbytes)
            t = time.perf_counter()
            cache.l1.get("x")
            l1.append(time.perf_counter() - t)
        mb = arr.nbytes / 1e6
        print(f"  {mib:>2} MiB: L2 put {mb / statistics.median(puts):7.0f} MB/s   L2 get "
              f"{mb / statistics.median(gets):7.0f} MB/s   L1 get {statistics.median(l1) * 1e6:6.1f} us")
        await cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    server = RedisServer(maxmemory="2gb").start()
    try:
        asyncio.run(prompt_costs(server.url, 5 if a.quick else 15))
        asyncio.run(l2_throughput(server.url, 5 if a.quick else 20))
    finally:
        server.close()


if __name__ == "__main__":
    main()

"""Encoder cache benchmark, in one run on a real redis-server:

- the preprocessor's cost to turn an 8000x576 float32 prompt_embeds payload into rows: cold (base64 decode +
  torch.save decode + validation); an L1 miss in a cache without L2 (decode + validate); an L1 hit; an L2 hit (a
  fresh replica whose size rule has learned nothing yet: the entry is read from Redis whatever it costs); an L1
  miss in a cache whose size rule has seen this size (what a running service does), with the entry in Redis (put
  there by a replica that had not learned yet) and without. All but cold start from the decoded payload and include
  hashing it;
- L2 hit vs decode side by side at 54 KiB, 1 MiB and 16 MiB of float32 rows: decode + validate of a torch.save
  payload of that size (what an L2 hit saves) against an L2 hit (header, transfer, integrity digest), the ratio, the
  L2 get/put MB/s, and what the size rule decides for that size after learning.

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

from embedmesh.core.embeds import ModelSpec, validate_embeds  # noqa: E402
from embedmesh.core.tensor_codec import decode_tensor_bytes  # noqa: E402
from embedmesh.services.encoder_cache.tiered import CacheConfig, CachedTensor, TieredCache  # noqa: E402
from embedmesh.services.preprocessor.prompt_embeds import EmbedsResolver, RawEmbeds  # noqa: E402
from embedmesh.tensor.v1 import tensor_pb2  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

HIDDEN = 576
SPEC = ModelSpec(HIDDEN, 16384, tensor_pb2.DATA_TYPE_FP32)
COLD = "cold: base64 + decode + validate (baseline)"
NO_L2 = "L1 miss, no L2 at all: decode + validate"
RULE = "L1 miss, size rule on, entry in Redis"
RULE_ABSENT = "L1 miss, size rule on, entry not in Redis"


def timed(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s) * 1e3:8.2f} ms   p99 {s[int(0.99 * (len(s) - 1))] * 1e3:8.2f} ms"


def torch_payload(rows: int) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(torch.randn(rows, HIDDEN), buf)
    return buf.getvalue()


async def learn(cache: TieredCache, payloads: list[bytes], resolve: EmbedsResolver | None = None) -> None:
    """What a long-running service has seen: these payloads decoded once each (misses), then read again after L1
    evicted them (L2 lookups), so the size rule has timings of both for their size."""
    async def compute_for(payload: bytes) -> CachedTensor:
        a, dtype = decode_tensor_bytes(payload, max_bytes=1 << 30, field="prompt_embeds")
        return CachedTensor(validate_embeds(a, dtype, SPEC, field="prompt_embeds", max_tokens=0), SPEC.dtype)

    for _ in range(2):
        for i, payload in enumerate(payloads):
            cache.l1 = type(cache.l1)(1 << 30)
            if resolve is not None:
                await resolve(RawEmbeds(encoded=payload), "prompt_embeds")
            else:
                await cache.get_or_compute(f"bench:learn:{len(payload)}:{i}", lambda p=payload: compute_for(p))


def decision(cache: TieredCache, nbytes: int) -> str:
    from embedmesh.services.encoder_cache.size_rule import size_class

    use = cache.rule.decided().get(size_class(nbytes))
    return "not decided" if use is None else "L2 used" if use else "L2 skipped"


async def prompt_costs(redis_url: str, repeats: int) -> None:
    import pybase64

    payload = torch_payload(8000)
    b64 = base64.b64encode(payload).decode()
    print(f"\nprompt_embeds 8000x{HIDDEN} float32 ({len(payload) / 1e6:.1f} MB torch.save, "
          f"{len(b64) / 1e6:.1f} MB base64): payload -> validated rows")
    results: dict[str, list[float]] = {COLD: [], NO_L2: [], RULE_ABSENT: [], RULE: [], "L1 hit": [],
                                       "L2 hit (size rule not applied)": []}
    # The service's cache is long-lived: it has seen this size before (rounds of miss, then L2 lookups).
    service = TieredCache(CacheConfig(capacity_bytes=1 << 30, redis_url=redis_url))
    served = EmbedsResolver(service, SPEC, 1 << 30, 16)
    await learn(service, [torch_payload(8000) for _ in range(service.rule.min_samples)], served)
    # A payload of the same size only this service decodes: with L2 skipped for its size, it is never stored.
    unseen_b64 = base64.b64encode(torch_payload(8000)).decode()
    for _ in range(repeats):
        for name in results:
            raw = pybase64.b64decode(b64 if name != RULE_ABSENT else unseen_b64, validate=True)
            if name in (RULE, RULE_ABSENT):  # what a running service does once its L1 evicted the payload's rows
                service.l1 = type(service.l1)(1 << 30)
                t = time.perf_counter()
                await served(RawEmbeds(encoded=raw), "prompt_embeds")
                results[name].append(time.perf_counter() - t)
                continue
            cache = TieredCache(CacheConfig(capacity_bytes=1 << 30, redis_url=redis_url))
            resolve = EmbedsResolver(cache, SPEC, 1 << 30, 16)
            await resolve(RawEmbeds(encoded=raw), "prompt_embeds")  # warm the tiers (and L2) for the hit cases
            if name.startswith("L2"):
                cache.l1 = type(cache.l1)(1 << 30)  # a replica that has not seen it: L1 empty, Redis has it
            if name in (COLD, NO_L2):
                await cache.close()
                cache = TieredCache(CacheConfig(capacity_bytes=1 << 30))
                resolve = EmbedsResolver(cache, SPEC, 1 << 30, 16)
            hits = cache.l2.counters.hits if cache.l2 is not None else 0
            t = time.perf_counter()
            if name.startswith("cold"):
                raw = pybase64.b64decode(b64, validate=True)
            await resolve(RawEmbeds(encoded=raw), "prompt_embeds")
            results[name].append(time.perf_counter() - t)
            if name.startswith("L2"):
                assert cache.l2 is not None and cache.l2.counters.hits == hits + 1, "the L2 case must read from L2"
            await cache.close()
    base = statistics.median(results[COLD])
    for name, samples in results.items():
        print(f"  {name:<46} {timed(samples)}   x{base / statistics.median(samples):5.1f} cheaper")
    print(f"  (size rule for {8000 * HIDDEN * 4 / 2**20:.1f} MiB of rows: {decision(service, 8000 * HIDDEN * 4)}; "
          "an upload-once id skips hashing too: see /v1/prompt_embeds)")
    await service.close()


async def l2_vs_decode(redis_url: str, repeats: int) -> None:
    print("\nL2 hit vs decode (float32 rows; ratio = decode / L2 hit, > 1: the L2 hit is faster). The size rule "
          "weighs a hit\nagainst the header lookup every L1 miss pays anyway plus decoding")
    print(f"  {'rows':>16}  {'decode+validate':>15}  {'L2 hit':>9}  {'ratio':>6}  {'L2 get':>11}  {'L2 put':>11}"
          f"  size rule")
    for rows in (24, (1 << 20) // (HIDDEN * 4), (16 << 20) // (HIDDEN * 4)):  # 54 KiB, 1 MiB, 16 MiB
        payload = torch_payload(rows)
        decodes, gets, puts, arr = [], [], [], None
        for _ in range(repeats):
            t = time.perf_counter()
            a, dtype = decode_tensor_bytes(payload, max_bytes=1 << 30, field="prompt_embeds")
            arr = validate_embeds(a, dtype, SPEC, field="prompt_embeds", max_tokens=0)
            decodes.append(time.perf_counter() - t)
        assert arr is not None
        cache = TieredCache(CacheConfig(capacity_bytes=1 << 30, redis_url=redis_url))
        assert cache.l2 is not None
        for i in range(repeats):  # entries written first, then read (a read right behind a write of the same
            t = time.perf_counter()  # size finds Redis's reply buffers on fresh pages: ~1.5x slower at 16 MiB)
            assert await cache.l2.put(f"bench:{rows}:{i}", arr, SPEC.dtype, 600)
            puts.append(time.perf_counter() - t)
        for i in range(repeats):
            t = time.perf_counter()
            got = await cache.l2.get(f"bench:{rows}:{i}")
            gets.append(time.perf_counter() - t)
            assert got is not None and np.array_equal(got[0], arr)
        await learn(cache, [torch_payload(rows) for _ in range(cache.rule.min_samples)])
        d, g, p = statistics.median(decodes), statistics.median(gets), statistics.median(puts)
        mb = arr.nbytes / 1e6
        size = f"{arr.nbytes / 2**10:.0f} KiB" if arr.nbytes < 1 << 19 else f"{arr.nbytes / 2**20:.1f} MiB"
        print(f"  {rows:>5} ({size:>7})  {d * 1e3:12.2f} ms  {g * 1e3:6.2f} ms  x{d / g:5.2f}  "
              f"{mb / g:6.0f} MB/s  {mb / p:6.0f} MB/s  {decision(cache, arr.nbytes)}")
        await cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    server = RedisServer(maxmemory="2gb").start()
    try:
        asyncio.run(prompt_costs(server.url, 5 if a.quick else 15))
        asyncio.run(l2_vs_decode(server.url, 5 if a.quick else 20))
    finally:
        server.close()


if __name__ == "__main__":
    main()

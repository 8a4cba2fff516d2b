"""The encode stage's cache across preprocessor replicas: encode vs. L1 hit vs. another replica's Redis L2 hit, in
one process, one run (issue 36: is replica affinity for images needed?).

Two ``VisionStage`` instances stand for two preprocessor replicas: each has its own in-process L1 and its own
bytes -> pixel digest map, and both share one real Redis (started here, as ``REDIS_URL`` would give them) as L2.
Each round takes one fresh image (scikit-image's chelsea.png with a few pixels changed, so the pixel digest is new)
and sends it

  1. to replica A: decode + encode (EfficientNet-Lite0 + the class-name projector), rows written to L1 and L2;
  2. to replica A again: an L1 hit (the file's bytes map to their pixel digest: no decoding);
  3. to replica B, which has never seen it: decode (B does not know the file) + an L2 hit, copied into B's L1;
  4. to replica B again: an L1 hit.

Step 3 is what a repeat costs without affinity (a load balancer sent it to the other replica), step 2 with it.
Medians over the rounds and their ratios; ``decode`` is ``decode_image`` alone on the same files, for reading step 3.
``--no-redis`` measures steps 1 and 2 only.

    .venv/bin/python bench/bench_images.py [--rounds 20] [--threads 1] [--no-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.core.embeds import ModelSpec  # noqa: E402
from embedmesh.models import ensure_default_model  # noqa: E402
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache  # noqa: E402
from embedmesh.tensor.v1 import tensor_pb2  # noqa: E402
from embedmesh.vision.decode import ImageLimits, decode_image  # noqa: E402
from embedmesh.vision.stage import Encoder, ImageSource, SoftPromptEncoder, VisionStage  # noqa: E402

SPEC = ModelSpec(hidden_size=576, max_context_tokens=8192, dtype=tensor_pb2.DATA_TYPE_FP32)


def variants(count: int) -> list[bytes]:
    path = Path(str(importlib.metadata.distribution("scikit-image").locate_file("skimage/data/chelsea.png")))
    base = np.array(Image.open(path).convert("RGB"))
    out = []
    for i in range(count):
        px = base.copy()
        px[i % px.shape[0], :8] = i % 256  # a new digest, the same picture
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def replica(folder: Path, encoder: Encoder, redis_url: str | None) -> VisionStage:
    """One preprocessor replica's stage: its own L1 (and bytes map), Redis as L2 when given; the encoder object is
    shared between the two only to load the weights once (encodes run on replica A alone)."""
    cache = TieredCache(CacheConfig(capacity_bytes=1 << 28, redis_url=redis_url))
    return VisionStage(cache, limits=ImageLimits(), folder_of=lambda model: folder, factory=lambda f: encoder)


async def timed(stage: VisionStage, data: bytes) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    rows = await stage.rows(ImageSource(data=data), model="m", spec=SPEC, field="image", max_tokens=1)
    return time.perf_counter() - t, rows


async def main(rounds: int, threads: int, redis: bool) -> None:
    folder = Path(ensure_default_model())
    server = None
    if redis:
        from tests.support.redis_server import RedisServer

        server = RedisServer().start()
    started = time.perf_counter()
    encoder = SoftPromptEncoder(folder, threads=threads)
    a, b = (replica(folder, encoder, server.url if server else None) for _ in range(2))
    try:
        images = variants(rounds + 1)
        await timed(a, images[0])  # warm-up: the first torch call
        load = time.perf_counter() - started
        steps: dict[str, list[float]] = {k: [] for k in ("encode", "l1", "l2", "l2 then l1", "decode")}
        for data in images[1:]:
            spent, rows = await timed(a, data)
            steps["encode"].append(spent)
            steps["l1"].append((await timed(a, data))[0])
            if server is not None:
                spent, other = await timed(b, data)
                assert np.array_equal(rows, other), "replica B's rows differ from A's"
                steps["l2"].append(spent)
                steps["l2 then l1"].append((await timed(b, data))[0])
            t = time.perf_counter()
            decode_image(data, "image", ImageLimits())
            steps["decode"].append(time.perf_counter() - t)
        computed = (a.cache.computed, b.cache.computed)
        hits = b.cache.l2.counters.hits if b.cache.l2 is not None else 0
    finally:
        for s in (a, b):
            await s.cache.close()
        if server is not None:
            server.close()
    p50 = {k: statistics.median(v) * 1e3 for k, v in steps.items() if v}
    print(f"encoder load + first image: {load:.2f} s; rows per image: {rows.shape[0]} x {rows.shape[1]}")
    print(f"{rounds} images (451x300 PNG), torch threads {threads}; encodes: replica A {computed[0]}, "
          f"replica B {computed[1]}; replica B's L2 hits {hits}")
    print(f"  encode (miss on A) p50: {p50['encode']:.1f} ms   L1 hit (repeat on A) p50: {p50['l1']:.2f} ms   "
          f"ratio {p50['encode'] / p50['l1']:.0f}x")
    if "l2" in p50:
        print(f"  repeat on replica B (decode + Redis L2 hit) p50: {p50['l2']:.1f} ms   (decode alone "
              f"{p50['decode']:.1f} ms; B's next repeat, L1: {p50['l2 then l1']:.2f} ms)")
        print(f"  encode / L2 hit {p50['encode'] / p50['l2']:.1f}x   L2 hit / L1 hit {p50['l2'] / p50['l1']:.0f}x   "
              f"with affinity / without (L1 / L2 hit) {p50['l1'] / p50['l2']:.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-redis", action="store_true", help="no second replica, no L2: encode vs. L1 hit only")
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.threads, not a.no_redis))

"""The encode stage's cache: an image part served from the encoder cache vs. encoded, in one process, one run.

Each round sends one fresh image (scikit-image's chelsea.png with a few pixels changed, so the pixel digest is new)
through ``VisionStage.rows`` twice: the first call decodes and encodes it (EfficientNet-Lite0 + the class-name
projector), the second decodes it and finds its rows in the cache (L1). Medians over the rounds, and their ratio;
both include decoding the PNG and hashing its pixels, which a hit still does (the key is the pixels' digest).

    .venv/bin/python bench/bench_images.py [--rounds 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import io
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from embedmesh.core.embeds import ModelSpec
from embedmesh.models import ensure_default_model
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.decode import ImageLimits
from embedmesh.vision.stage import ImageSource, SoftPromptEncoder, VisionStage


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


async def main(rounds: int, threads: int) -> None:
    folder = Path(ensure_default_model())
    spec = ModelSpec(hidden_size=576, max_context_tokens=8192, dtype=tensor_pb2.DATA_TYPE_FP32)
    stage = VisionStage(TieredCache(CacheConfig(capacity_bytes=1 << 28)), limits=ImageLimits(),
                        folder_of=lambda model: folder, factory=lambda f: SoftPromptEncoder(f, threads=threads))
    images = variants(rounds + 1)
    warm = ImageSource(data=images[0])
    started = time.perf_counter()
    await stage.rows(warm, model="m", spec=spec, field="image", max_tokens=1)  # loads the encoder
    load = time.perf_counter() - started
    miss, hit = [], []
    for data in images[1:]:
        for times in (miss, hit):
            t = time.perf_counter()
            rows = await stage.rows(ImageSource(data=data), model="m", spec=spec, field="image", max_tokens=1)
            times.append(time.perf_counter() - t)
    m, h = statistics.median(miss), statistics.median(hit)
    print(f"encoder load + first image: {load:.2f} s; rows per image: {rows.shape[0]} x {rows.shape[1]}")
    print(f"{rounds} images (451x300 PNG), torch threads {threads}")
    print(f"  encode (miss) p50: {m * 1e3:.1f} ms   cache hit p50: {h * 1e3:.1f} ms   ratio {m / h:.1f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.threads))

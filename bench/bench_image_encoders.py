"""Encode time per image of the two image encoders, in one process, one run: EfficientNet-Lite0 + the class-name
projector (the default) against DINOv2-small + a LLaVA-style projector (a seeded random one, 384 -> 576 -> 576).

Each encoder is built once, warmed with one image, then ``encode`` (tower + projector, the work a cache miss does;
no decoding) runs ``--rounds`` times on scikit-image's chelsea.png, one torch thread as in the preprocessor. Prints
the median and p90 per encoder and their ratio.

    .venv/bin/python bench/bench_image_encoders.py [--rounds 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.models import ensure_default_model  # noqa: E402
from embedmesh.vision.dinov2 import Dinov2Encoder  # noqa: E402
from embedmesh.vision.stage import SoftPromptEncoder  # noqa: E402


def random_projector(folder: Path, hidden: int) -> Path:
    rng = np.random.default_rng(0)
    save_file({"0.weight": (rng.standard_normal((hidden, 384)) / 20).astype(np.float32),
               "0.bias": np.zeros(hidden, np.float32),
               "2.weight": (rng.standard_normal((hidden, hidden)) / 20).astype(np.float32),
               "2.bias": np.zeros(hidden, np.float32)}, str(folder / "mm_projector.safetensors"))
    return folder


def timed(encode, pixels: np.ndarray, rounds: int) -> tuple[list[float], tuple[int, ...]]:  # type: ignore[no-untyped-def]
    shape = encode(pixels).shape  # warm-up
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        encode(pixels)
        out.append(time.perf_counter() - t)
    return out, shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    folder = ensure_default_model()
    dist = importlib.metadata.distribution("scikit-image")
    pixels = np.asarray(Image.open(Path(str(dist.locate_file("skimage/data/chelsea.png")))).convert("RGB"))
    encoders = {"efficientnet-lite0": SoftPromptEncoder(folder, threads=args.threads),
                "dinov2": Dinov2Encoder(folder, random_projector(Path(tempfile.mkdtemp()), 576), threads=args.threads)}
    medians = {}
    for name, enc in encoders.items():
        times, shape = timed(enc.encode, pixels, args.rounds)
        medians[name] = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        print(f"{name:20s} rows {shape}  median {medians[name] * 1e3:7.1f} ms  p90 {p90 * 1e3:7.1f} ms "
              f"({args.rounds} encodes, {args.threads} torch thread(s), image {pixels.shape[1]}x{pixels.shape[0]})")
    print(f"dinov2 / efficientnet-lite0 median: {medians['dinov2'] / medians['efficientnet-lite0']:.2f}x")


if __name__ == "__main__":
    main()

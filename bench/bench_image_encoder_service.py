"""Encode latency of one image in the preprocessor's process against through the image encode service (a separate
process on this machine, ``embedmesh.services.image_encoder``), one run, alternating, after one warm-up each.

    in process   ``asyncio.to_thread(encoder.encode, pixels)``: what the in-process stage does on a cache miss
    service      ``EncodeServiceClient.encode`` (pixels as a UINT8 Tensor over gRPC, FP32 rows back) + the
                 preprocessor's checks of the answer (``to_numpy``, ``validate_embeds``): what the remote mode does

EfficientNet-Lite0 + the class-name projector (the default) on scikit-image's chelsea.png (451 x 300), one torch
thread on both sides. Prints the medians, their ratio, and the service's own encode time (``encode_seconds``), so
the difference is the hop: serialization, loopback gRPC, the second process.

    .venv/bin/python bench/bench_image_encoder_service.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.core.embeds import ModelSpec, validate_embeds  # noqa: E402
from embedmesh.core.tensors import to_numpy  # noqa: E402
from embedmesh.models import ensure_default_model  # noqa: E402
from embedmesh.tensor.v1 import tensor_pb2  # noqa: E402
from embedmesh.vision.remote import EncodeServiceClient  # noqa: E402
from embedmesh.vision.stage import SoftPromptEncoder  # noqa: E402

SPEC = ModelSpec(hidden_size=576, max_context_tokens=8192, dtype=tensor_pb2.DATA_TYPE_FP32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(rounds: int) -> None:
    path = Path(str(importlib.metadata.distribution("scikit-image").locate_file("skimage/data/chelsea.png")))
    pixels = np.asarray(Image.open(path).convert("RGB"))
    port = free_port()
    service = subprocess.Popen([sys.executable, "-m", "embedmesh.services.image_encoder.main", "--port", str(port)],
                               env={**os.environ, "EMBEDMESH_TRACE_CONSOLE": "0"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    client = EncodeServiceClient([f"127.0.0.1:{port}"], "efficientnet-lite0", 64 << 20)
    try:
        local = SoftPromptEncoder(Path(ensure_default_model()))
        for _ in range(600):  # the service's port opens once it has imported its modules
            try:
                remote = await client.describe("SmolLM2-135M-Instruct", "image")
                break
            except Exception:  # noqa: BLE001 - not listening yet
                await asyncio.sleep(0.1)
        assert remote.identity == local.identity

        async def in_process() -> np.ndarray:
            return await asyncio.to_thread(local.encode, pixels)

        seconds: list[float] = []

        async def through_service() -> np.ndarray:
            response = await client.encode(remote, pixels, "image")
            seconds.append(response.encode_seconds)
            answer = response.rows
            arr, dtype = to_numpy(answer, field="image", data=memoryview(answer.data))
            return validate_embeds(arr, dtype, SPEC, field="image", max_tokens=0)

        a, b = await in_process(), await through_service()  # warm-up, and the same rows both ways
        assert np.array_equal(a, b), "the service's rows differ from the in-process encoder's"
        times: dict[str, list[float]] = {"in process": [], "service": []}
        for _ in range(rounds):
            for name, fn in (("in process", in_process), ("service", through_service)):
                t = time.perf_counter()
                await fn()
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"chelsea.png {pixels.shape[1]}x{pixels.shape[0]} -> {a.shape} rows, {rounds} rounds each, alternating")
        for k, v in times.items():
            print(f"  {k:<11} median {med[k]:7.1f} ms   p90 {np.percentile(v, 90) * 1e3:7.1f} ms")
        print(f"  (the service's own encode_seconds: median {statistics.median(seconds[1:]) * 1e3:.1f} ms)")
        print(f"  service / in process: {med['service'] / med['in process']:.2f}x "
              f"(+{med['service'] - med['in process']:.1f} ms per miss)")
    finally:
        await client.close()
        service.terminate()
        service.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    asyncio.run(run(p.parse_args().rounds))


if __name__ == "__main__":
    main()

"""Embeddings ingest through the clients, side by side in one run (echo engine: no model, max_tokens=1):
the official openai SDK (base64 of torch.save in JSON, through the gateway; the baseline) vs the Python gRPC
client sending raw bytes (Generate rows in 1 MiB pieces from 1 MiB up, streamed through to the worker from 8 MiB
up; one message below) and uploading in 1 MiB chunks then completing by id.

    python bench/bench_clients.py [--quick]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import start_mesh  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    import openai
    import torch
    from embedmesh_client import Client

    repeats = 3 if a.quick else 7
    mesh = start_mesh(engine="echo")
    try:
        sdk = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        grpc_client = Client(mesh.preprocessor, timeout=300)
        print(f"\nembeddings ingest, MB/s of float32 tensor bytes (median of {repeats}; echo engine, max_tokens=1)")
        print(f"  {'tensor':<22}{'openai SDK (baseline)':>24}{'gRPC raw bytes':>18}{'gRPC chunked upload':>22}")
        for label, rows in (("1k x 576", 1000), ("8k x 576", 8000), ("64 MiB (29127 x 576)", 29127)):
            arr = np.random.default_rng(rows).standard_normal((rows, 576), dtype=np.float32)
            mb = arr.nbytes / 1e6

            def via_sdk(arr: np.ndarray = arr) -> None:
                buf = io.BytesIO()
                torch.save(torch.from_numpy(arr), buf)
                sdk.completions.create(model="echo", prompt="", max_tokens=1,
                                       extra_body={"prompt_embeds": base64.b64encode(buf.getvalue()).decode()})

            def via_raw(arr: np.ndarray = arr) -> None:
                grpc_client.complete("echo", embeds=arr, max_tokens=1)

            def via_upload(arr: np.ndarray = arr) -> None:
                key = grpc_client.upload_embeds(arr)
                grpc_client.complete("echo", embeds=key, max_tokens=1)

            cells = []
            for fn in (via_sdk, via_raw, via_upload):
                fn()
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                cells.append(mb / statistics.median(times))
            base = cells[0]
            print(f"  {label:<22}{cells[0]:>18.0f} MB/s{cells[1]:>11.0f} x{cells[1] / base:<4.1f}"
                  f"{cells[2]:>15.0f} x{cells[2] / base:.1f}")
        grpc_client.close()
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()

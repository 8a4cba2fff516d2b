"""Flame graphs (py-spy, SVG) of the mesh's services under three loads, for docs/perf/:

    rest     REST /v1/completions, prompt [1,2,3], max_tokens=1, 1 client          (gateway, preprocessor, worker)
    ingest   gRPC Generate with a 64 MiB float32 prompt_embeds tensor, max_tokens=1 (preprocessor, worker)
    chunks   the same tensor as a Generate pieces stream of 1 MiB pieces           (preprocessor, worker)
    restingest  REST /v1/completions with the same tensor as base64 torch.save     (gateway, preprocessor, worker)
    stream   64 concurrent streamed gRPC Generate calls of 256 tokens               (preprocessor, worker)

on an echo-engine mesh (no model time). Needs py-spy (pip install py-spy) and permission to attach (root here).

    python bench/flamegraphs.py --out docs/perf --tag after [--only rest,ingest,chunks,stream] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import start_mesh  # noqa: E402

SERVICES = {"gateway": "embedmesh.gateway", "preprocessor": "embedmesh.services.preprocessor.main",
            "router": "embedmesh.services.router.main", "worker": "embedmesh.services.worker.main"}
WHO = {"rest": ("gateway", "preprocessor", "worker"), "restingest": ("gateway", "preprocessor", "worker"),
       "ingest": ("preprocessor", "worker"),
       "chunks": ("preprocessor", "worker"), "stream": ("preprocessor", "worker")}


def service_pids(launcher: int) -> dict[str, str]:
    """The launcher's service processes by name (pid as text)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split():
        cmd = Path(f"/proc/{pid}/cmdline").read_text()
        for name, module in SERVICES.items():
            if module in cmd:
                out[name] = pid
    return out


async def _rest(mesh: object, stop: float) -> int:
    import httpx

    n = 0
    async with httpx.AsyncClient(base_url=mesh.base_url) as c:  # type: ignore[attr-defined]
        while time.monotonic() < stop:
            r = await c.post("/v1/completions", json={"model": "echo", "prompt": [1, 2, 3], "max_tokens": 1})
            r.raise_for_status()
            n += 1
    return n


def _channel(mesh: object) -> object:
    import grpc

    return grpc.aio.insecure_channel(mesh.preprocessor, options=[  # type: ignore[attr-defined]
        ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)])


async def _ingest(mesh: object, stop: float) -> int:
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2

    rows = np.random.default_rng(0).standard_normal((29127, 576)).astype("<f4")
    import mesh_generate

    params = inference_pb2.CompletionParams(model="echo", prompt_embeds=[
        inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(rows.shape),
                                                            data=rows.tobytes()))])
    params.sampling.max_tokens = 1
    req = mesh_generate.request_bytes(params)
    channel = _channel(mesh)
    call = mesh_generate.one_message(channel)
    n = 0
    while time.monotonic() < stop:
        await mesh_generate.whole(call(req, timeout=120))
        n += 1
    await channel.close()
    return n


async def _chunks(mesh: object, stop: float) -> int:
    """The same 64 MiB tensor as ``_ingest``, sent as a Generate pieces stream of 1 MiB pieces (streamed through to
    the worker as it arrives)."""
    import grpc

    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2

    rows = np.random.default_rng(0).standard_normal((29127, 576)).astype("<f4")
    raw = rows.tobytes()
    import mesh_generate

    head = inference_pb2.CompletionParams(model="echo", prompt_embeds=[
        inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(rows.shape)))])
    head.sampling.max_tokens = 1
    messages = [mesh_generate.request_bytes(head)] + [
        inference_pb2.GenerateRequest(rows=raw[i:i + (1 << 20)]).SerializeToString()
        for i in range(0, len(raw), 1 << 20)]
    channel = grpc.aio.insecure_channel(mesh.preprocessor)  # type: ignore[attr-defined]
    call = mesh_generate.pieces(channel)
    n = 0
    while time.monotonic() < stop:
        await mesh_generate.whole(call(iter(messages), timeout=120))
        n += 1
    await channel.close()
    return n


async def _stream(mesh: object, stop: float) -> int:
    import mesh_generate

    from embedmesh.inference.v1 import inference_pb2

    params = inference_pb2.CompletionParams(model="echo", prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
    params.sampling.max_tokens = 256
    req = mesh_generate.request_bytes(params, stream=True)
    channel = _channel(mesh)
    call = mesh_generate.one_message(channel)
    count = 0

    async def client() -> None:
        nonlocal count
        while time.monotonic() < stop:
            async for _ in call(req, timeout=120):
                pass
            count += 1

    await asyncio.gather(*(client() for _ in range(64)))
    await channel.close()
    return count


async def _restingest(mesh: object, stop: float) -> int:
    """REST /v1/completions with the same 64 MiB tensor as base64 torch.save (what the openai SDK sends): from the
    gateway as Generate pieces, or as one message with EMBEDMESH_GATEWAY_PIECES_MIN_BYTES=0."""
    import base64
    import io

    import httpx
    import torch

    buf = io.BytesIO()
    torch.save(torch.from_numpy(np.random.default_rng(0).standard_normal((29127, 576)).astype("<f4")), buf)
    import orjson

    body = orjson.dumps({"model": "echo", "prompt": "", "max_tokens": 1,
                         "prompt_embeds": base64.b64encode(buf.getvalue()).decode()})
    n = 0
    async with httpx.AsyncClient(base_url=mesh.base_url, timeout=120) as c:  # type: ignore[attr-defined]
        while time.monotonic() < stop:
            r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            r.raise_for_status()
            n += 1
    return n


LOADS = {"rest": _rest, "ingest": _ingest, "chunks": _chunks, "stream": _stream, "restingest": _restingest}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/perf")
    p.add_argument("--tag", default="after")
    p.add_argument("--only", default="rest,ingest,chunks,stream,restingest")
    p.add_argument("--seconds", type=float, default=8.0)
    a = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = start_mesh(engine="echo", extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"],
                      env={"EMBEDMESH_TRACE_CONSOLE": "0"})
    try:
        pids = service_pids(mesh.proc.pid)
        for load in a.only.split(","):
            asyncio.run(LOADS[load](mesh, time.monotonic() + 1.0))  # warm up
            spies = [subprocess.Popen([spy, "record", "-p", pids[who], "-o", str(out / f"{load}-{who}-{a.tag}.svg"),
                                       "-r", "250", "-d", str(int(a.seconds)), "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for who in WHO[load]]
            n = asyncio.run(LOADS[load](mesh, time.monotonic() + a.seconds))
            for s in spies:
                s.wait(timeout=60)
            files = ", ".join(f"{load}-{w}-{a.tag}.svg" for w in WHO[load])
            print(f"{load}: {n} requests in {a.seconds:g} s -> {files}")
    finally:
        mesh.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("EMBEDMESH_TRACE_CONSOLE", "0")
    raise SystemExit(main())

"""CPU per request, process by process (issue #18): where a tiny gRPC completion's cost goes, beside a bare grpc.aio
unary hop measured the same way in the same run.

Each figure is the CPU time (user + system, from ``/proc/<pid>/stat``) a process spent over N sequential requests,
divided by N, after a warm-up; the load generator's own CPU is measured too. Meshes (echo engine, so no model
time): the router as its own service (``--router-process``), the router in the preprocessor (the default with one
replica, named with ``--embedded-router``), and each again with
``--worker-streams off`` (a GenerateMany call of its own per request instead of a frame on the worker's shared
stream) and with
``EMBEDMESH_EVENT_LOOP=asyncio`` (the standard loop instead of uvloop). The limit: the bare grpc.aio unary server of
``bench_fastpath.py`` (L1), one hop. The first and third meshes are also driven over REST (``POST /v1/completions``
through the gateway, by ``bench_fastpath.LightHttp``), beside the bare uvicorn + Starlette route (L2) driven the same
way.

    python bench/bench_cpu.py [--quick] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_fastpath import BARE_SERVICE, BENCH_ENV, BareServer, LightHttp  # noqa: E402
from flamegraphs import service_pids  # noqa: E402

from tests.support.mesh import start_mesh  # noqa: E402

ORDER = ("gateway", "preprocessor", "router", "worker")
REST_TOO = {"router service", "router in the preprocessor"}
"""Variants also driven over REST (POST /v1/completions through the gateway, by the light HTTP client)."""
REST_BODY = b'{"model": "echo", "prompt": [1, 2, 3], "max_tokens": 1}'

STREAMS_OFF = {"EMBEDMESH_PREPROCESSOR_WORKER_STREAMS": "off"}
VARIANTS: list[tuple[str, list[str], dict[str, str]]] = [
    ("router service", ["--router-process"], {}),
    ("router service, worker streams off", ["--router-process"], STREAMS_OFF),
    ("router in the preprocessor", ["--embedded-router"], {}),
    ("router in the preprocessor, worker streams off", ["--embedded-router"], STREAMS_OFF),
    ("router in the preprocessor, asyncio loop", ["--embedded-router"], {"EMBEDMESH_EVENT_LOOP": "asyncio"}),
]
"""(label, launcher arguments, environment of the mesh's processes)."""


def cpu_seconds(pid: int | str) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(call: Any, n: int, pids: dict[str, Any]) -> dict[str, float]:
    for _ in range(min(300, n)):
        await call()
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    me = time.process_time()
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    out = {k: (cpu_seconds(p) - before[k]) / n * 1e3 for k, p in pids.items()}
    out["client"] = (time.process_time() - me) / n * 1e3
    out["p50_ms"] = statistics.median(lat) * 1e3
    out["mean_ms"] = wall / n * 1e3
    return out


async def _rest_run(address: str, n: int, pids: dict[str, Any]) -> dict[str, float]:
    client = LightHttp(address)
    request = client.post("/v1/completions", REST_BODY)

    async def call() -> None:
        status, answer = await client.send(request)
        assert status == 200, answer

    try:
        return await measure(call, n, pids)
    finally:
        client.close()


async def _mesh_run(address: str, request: Any, n: int, pids: dict[str, str]) -> dict[str, float]:
    import grpc
    import mesh_generate

    async with grpc.aio.insecure_channel(address) as ch:
        generate = mesh_generate.one_message(ch)
        return await measure(lambda: mesh_generate.whole(generate(request)), n, pids)


COLUMNS = ["server", *ORDER, "client"]


def _table(rows: list[tuple[str, dict[str, float]]], prefix: str, ratio_line: str) -> None:
    """Print ``rows`` (the first one the limit) and each mesh row's CPU sum over the limit's."""
    print(f"\n  {'path':<58}" + "".join(f"{c:>13}" for c in COLUMNS) + f"{'sum':>9}{'p50 ms':>9}")
    sums = [sum(v for k, v in fig.items() if k in COLUMNS) for _, fig in rows]
    for (label, fig), total in zip(rows, sums, strict=True):
        print(f"  {label:<58}" + "".join(f"{fig[c]:>13.3f}" if c in fig else f"{'':>13}" for c in COLUMNS)
              + f"{total:>9.3f}{fig['p50_ms']:>9.3f}")
    ratios = [f"{label.removeprefix(prefix)} x{total / sums[0]:.2f}"
              for (label, _), total in zip(rows[1:], sums[1:], strict=True)]
    print(f"\n  {ratio_line} (both with their load generator): " + ", ".join(ratios))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, default=0)
    a = p.parse_args()
    n = a.requests or (1500 if a.quick else 4000)
    os.environ.update(BENCH_ENV)
    import grpc

    from embedmesh.inference.v1 import inference_pb2

    params = inference_pb2.CompletionParams(model="echo", prompt_token_ids=[inference_pb2.TokenIds(ids=[1, 2, 3])])
    params.sampling.max_tokens = 1
    import mesh_generate

    request = mesh_generate.request_bytes(params)
    small = inference_pb2.CompleteResponse(id="cmpl-0", model="echo",
                                           choices=[inference_pb2.Choice(index=0, text="x")]).SerializeToString()
    print(f"CPU per request, ms (user + system over {n} sequential requests after a warm-up; 2 cores; prompt "
          "[1,2,3], max_tokens=1, echo engine)", flush=True)
    rows: list[tuple[str, dict[str, float]]] = []

    bare = BareServer("grpc", dict(os.environ))
    try:
        bare.wait_ready()

        async def bare_run() -> dict[str, float]:
            async with grpc.aio.insecure_channel(bare.address) as ch:
                hop = ch.unary_unary(BARE_SERVICE + "Unary")
                return await measure(lambda: hop(small), n, {"server": bare.proc.pid})

        rows.append(("L1 bare grpc.aio unary hop", asyncio.run(bare_run())))
    finally:
        bare.stop()
    bare_http = BareServer("http", dict(os.environ))
    try:
        bare_http.wait_ready()
        rest_rows = [("L2 bare uvicorn + Starlette route (light HTTP client)",
                      asyncio.run(_rest_run(bare_http.address, n, {"server": bare_http.proc.pid})))]
    finally:
        bare_http.stop()

    for label, args, env in VARIANTS:
        mesh = start_mesh(engine="echo", workers=1, extra_args=args, env=env)
        try:
            pids = {k: v for k, v in service_pids(mesh.proc.pid).items() if k in ORDER}
            grpc_pids = {k: v for k, v in pids.items() if k != "gateway"}

            rows.append((f"mesh gRPC, {label}", asyncio.run(_mesh_run(mesh.preprocessor, request, n, grpc_pids))))
            if label in REST_TOO:
                rest_rows.append((f"mesh REST, {label}", asyncio.run(_rest_run(mesh.base_url, n, pids))))
        finally:
            mesh.stop()

    _table(rows, "mesh gRPC, ", "the mesh's CPU per request over a bare hop's")
    print()
    _table(rest_rows, "mesh REST, ", "REST: the mesh's CPU per request over the bare route's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

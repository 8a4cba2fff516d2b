"""The Batch API through a real mesh (one mocker worker: prefill costs per prompt position not in its simulated KV
cache, which holds only a few long prefixes) and gateways of its own (``--batch-order``, ``--batch-pause-inflight``):

1. **Order**: a batch of 20 long shared prefixes x N lines, the file interleaving them (line i uses prefix i % 20),
   run in prefix order and in file order, alternating, each run with fresh prefixes (nothing cached from the last
   one). Lines/s from create to completed; the ratio prefix / file in the same run.
2. **Interactive first**: closed-loop streamed completions (short fresh prompts, a think time between requests),
   TTFT p50/p99: alone; beside a batch running on the same gateway that waits for a quiet second
   (``--batch-busy-concurrency 0``), that trickles one line at a time between interactive requests (the default, 1),
   and on a gateway that does not wait (``--batch-pause-inflight 0``). The batch lines finished during each window
   are counted too (what the batch got). TTFTs of the first second are not counted: the batch's lines already
   running when the interactive traffic begins (up to ``--batch-concurrency``) finish first.

Last line: ``batch: prefix_over_file=X ttft_p99_quiet_over_alone=Y ttft_p99_trickle_over_alone=Z
ttft_p99_no_wait_over_alone=W``.

    python bench/bench_batch.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.support.mesh import Mesh, free_port, start_mesh  # noqa: E402

PREFIXES = 20
WARMUP_S = 1.0
FILLER = "the quick brown fox jumps over the lazy dog while the band plays on " * 60  # ~900 tokens


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _gateway(mesh: Mesh, db: str, **settings: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "EMBEDMESH_GATEWAY_BATCH_DB": db, "EMBEDMESH_TRACE_CONSOLE": "0",
           **{f"EMBEDMESH_GATEWAY_{k.upper()}": v for k, v in settings.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.gateway.main", "--port", str(port), "--preprocessor",
                             mesh.preprocessor], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("gateway did not start")


async def _create(c: httpx.AsyncClient, lines: list[dict]) -> str:
    data = ("\n".join(json.dumps(x) for x in lines) + "\n").encode()
    f = (await c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})).json()
    b = await c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                          "completion_window": "24h"})
    return str(b.json()["id"])


async def _wait(c: httpx.AsyncClient, bid: str) -> dict:
    while True:
        b = (await c.get(f"/v1/batches/{bid}")).json()
        if b["status"] in ("completed", "cancelled", "failed"):
            return b
        await asyncio.sleep(0.1)


def _prefix_batch(per_prefix: int) -> list[dict]:
    salt = secrets.token_hex(4)
    return [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "mocker", "max_tokens": 4,
                      "prompt": f"[{salt} document {i % PREFIXES}] {FILLER} Question {i}: what happened?"}}
            for i in range(PREFIXES * per_prefix)]


async def _order_run(url: str, per_prefix: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        lines = _prefix_batch(per_prefix)
        t0 = time.monotonic()
        b = await _wait(c, await _create(c, lines))
        elapsed = time.monotonic() - t0
    assert b["request_counts"]["completed"] == len(lines), b
    return len(lines) / elapsed


async def _interactive(url: str, seconds: float, clients: int, think: float,
                       batch_url: str | None, batch_lines: int) -> tuple[list[float], int]:
    """TTFTs of closed-loop clients at ``url``; with ``batch_url``, a batch runs there meanwhile (cancelled after);
    returns the TTFTs and the batch lines finished in the window."""
    ttft: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as c, \
            httpx.AsyncClient(base_url=batch_url or url, timeout=600) as bc:
        bid = None
        if batch_url:
            bid = await _create(bc, [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {"model": "mocker", "max_tokens": 16,
                                               "prompt": f"{secrets.token_hex(8)} background job {i} " * 20}}
                                     for i in range(batch_lines)])
            while (await bc.get(f"/v1/batches/{bid}")).json()["request_counts"]["completed"] < 4:
                await asyncio.sleep(0.05)  # the batch is running
        start_done = (await bc.get(f"/v1/batches/{bid}")).json()["request_counts"]["completed"] if bid else 0
        began = time.monotonic()
        until = began + WARMUP_S + seconds

        async def client() -> None:
            while time.monotonic() < until:
                t0 = time.monotonic()
                async with c.stream("POST", "/v1/completions", json={
                        "model": "mocker", "prompt": f"{secrets.token_hex(6)} hello there " * 8, "max_tokens": 8,
                        "stream": True}) as r:
                    first = None
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.monotonic() - t0
                if first is not None and t0 >= began + WARMUP_S:  # lines already running when traffic began
                    ttft.append(first)                                # finish first: the warm-up is not counted
                await asyncio.sleep(think)

        await asyncio.gather(*(client() for _ in range(clients)))
        done = 0
        if bid:
            done = (await bc.get(f"/v1/batches/{bid}")).json()["request_counts"]["completed"] - start_done
            await bc.post(f"/v1/batches/{bid}/cancel")
            await _wait(bc, bid)
    return ttft, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer lines, shorter windows")
    a = ap.parse_args()
    per_prefix, reps, seconds = (3, 1, 8.0) if a.quick else (5, 2, 15.0)
    work = Path(tempfile.mkdtemp(prefix="embedmesh-bench-batch-"))
    # 400 blocks x 16 positions: about 6 of the 20 ~900-token prefixes fit in the simulated cache.
    mesh = start_mesh(engine="mocker", workers=1, env={
        "EMBEDMESH_WORKER_MOCKER_NUM_BLOCKS": "400", "EMBEDMESH_WORKER_MOCKER_MAX_CONTEXT_TOKENS": "2048",
        "EMBEDMESH_WORKER_MOCKER_PREFILL_MS_PER_TOKEN": "0.1", "EMBEDMESH_WORKER_MOCKER_DECODE_MS": "5",
        "EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_GATEWAY_BATCH_DB": str(work / "mesh.sqlite3")})
    procs: list[subprocess.Popen[bytes]] = []
    try:
        gp, prefix_url = _gateway(mesh, str(work / "p.sqlite3"))
        gf, file_url = _gateway(mesh, str(work / "f.sqlite3"), batch_order="file")
        gn, nopause_url = _gateway(mesh, str(work / "n.sqlite3"), batch_pause_inflight="0")
        gs, quiet_url = _gateway(mesh, str(work / "s.sqlite3"), batch_busy_concurrency="0")
        procs += [gp, gf, gn, gs]
        print(f"batch: 1 mocker worker (0.1 ms prefill per uncached position, ~6 of {PREFIXES} prefixes fit its "
              f"cache), batch concurrency 4", flush=True)
        rates: dict[str, list[float]] = {"file": [], "prefix": []}
        for _ in range(reps):
            for order, url in (("file", file_url), ("prefix", prefix_url)):
                print(f"... {PREFIXES * per_prefix} lines, {order} order", flush=True)
                rates[order].append(asyncio.run(_order_run(url, per_prefix)))
        runs = {}
        for name, url, batch in (("alone", prefix_url, None),
                                 ("beside a batch (waits for a quiet second)", quiet_url, quiet_url),
                                 ("beside a batch (trickles: 1 line while busy)", prefix_url, prefix_url),
                                 ("beside a batch (does not wait)", nopause_url, nopause_url)):
            print(f"... interactive {name}", flush=True)
            runs[name] = asyncio.run(_interactive(url, seconds, clients=4, think=0.1, batch_url=batch,
                                                  batch_lines=3000))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)
        mesh.stop()

    print("\n| batch order | lines/s (each run) | mean |")
    print("|---|---|---|")
    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    for k in ("file", "prefix"):
        print(f"| {k} | {', '.join(f'{r:.1f}' for r in rates[k])} | {mean[k]:.1f} |")
    print(f"\n| interactive (4 clients, 100 ms think, {seconds:g} s) | requests | TTFT p50 ms | TTFT p99 ms | "
          "batch lines done |")
    print("|---|---|---|---|---|")
    for name, (ttft, done) in runs.items():
        print(f"| {name} | {len(ttft)} | {_pct(ttft, 0.5) * 1e3:.0f} | {_pct(ttft, 0.99) * 1e3:.0f} | {done} |")
    alone = _pct(runs["alone"][0], 0.99)
    ratio = {k: _pct(v[0], 0.99) / alone for k, v in runs.items()}
    print(f"\nbatch: prefix_over_file={mean['prefix'] / mean['file']:.2f} "
          f"ttft_p99_quiet_over_alone={ratio['beside a batch (waits for a quiet second)']:.2f} "
          f"ttft_p99_trickle_over_alone={ratio['beside a batch (trickles: 1 line while busy)']:.2f} "
          f"ttft_p99_no_wait_over_alone={ratio['beside a batch (does not wait)']:.2f}")


if __name__ == "__main__":
    main()

"""Embeddings benchmark: sentences/s at batch 1 and batch 32, through the mesh (openai SDK -> gateway ->
preprocessor -> embedding worker) vs the engine called in-process, for the ``hf`` worker (transformers,
all-MiniLM-L6-v2) and, when its venv exists, the ``sglang`` worker (sglang==0.5.23 on the CPU).

Every sentence is new (a per-run nonce), so the encoder cache never answers: these are compute figures. The mesh's
embedding worker runs with 1 torch thread (as the launcher starts it), and so does the in-process hf engine; SGLang
binds its scheduler to the cores it finds.

The mesh is driven twice: by the openai SDK (what users run) and by a light client (``http.client`` + orjson),
since on these 2 cores the SDK's own CPU per call competes with the mesh's processes.

Each figure is the best of several rounds of sequential calls (timeit's rule: on a shared machine other work only
ever adds time, so the fastest round is the closest to the path's own cost); in-process and mesh get the same rounds.
The last column is the mesh's rate as a share of the in-process one.

    python bench/bench_embeddings.py [--quick] [--engines hf,sglang]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "all-MiniLM-L6-v2"
WORDS = "alpha beta gamma delta river mountain engine signal vector garden window cloud market".split()


def sentences(n: int, nonce: str) -> list[str]:
    """Distinct sentences of ~12 tokens (never seen by the cache)."""
    return [f"{nonce} {i}: the {WORDS[i % len(WORDS)]} and the {WORDS[(i * 7) % len(WORDS)]} meet at dawn"
            for i in range(n)]


def rate(call: Callable[[list[str]], object], batch: int, requests: int, rounds: int) -> float:
    """Sentences/s of the best of ``rounds`` rounds of ``requests`` sequential calls of ``batch`` sentences (after
    one warm-up call)."""
    nonce = uuid.uuid4().hex[:8]
    call(sentences(batch, nonce + "w"))
    best = 0.0
    for n in range(rounds):
        texts = sentences(batch * requests, f"{nonce}r{n}")
        start = time.perf_counter()
        for r in range(requests):
            call(texts[r * batch:(r + 1) * batch])
        best = max(best, batch * requests / (time.perf_counter() - start))
    return best


def plan(quick: bool) -> list[tuple[int, int, int]]:
    """(batch, requests per round, rounds)."""
    return [(1, 20, 5), (32, 2, 5)] if quick else [(1, 50, 8), (32, 5, 8)]


# --- in-process engines -----------------------------------------------------------------------------------------
def hf_in_process(quick: bool) -> dict[int, float]:
    from embedmesh.models.minilm import minilm_dir
    from embedmesh.services.worker.engines.hf_embed.engine import HFEmbedConfig, HFEmbedEngine

    async def run() -> dict[int, float]:
        engine = HFEmbedEngine(HFEmbedConfig(minilm_dir(), MODEL, threads=1))
        await engine.start()
        loop = asyncio.get_running_loop()
        out = {}
        for batch, requests, rounds in plan(quick):
            # Called from a thread so the engine's event-loop bridge is the one the worker uses.
            out[batch] = await loop.run_in_executor(
                None, rate, lambda xs: asyncio.run_coroutine_threadsafe(engine.embed(xs), loop).result(), batch,
                requests, rounds)
        await engine.shutdown()
        return out

    return asyncio.run(run())


def sglang_in_process(quick: bool) -> dict[int, float]:
    """Runs inside the SGLang venv (``--sglang-in-process``): our adapter over sglang.Engine in this process."""
    from embedmesh.models.minilm import minilm_dir
    from embedmesh.services.worker.engines.sglang.engine import SGLangConfig, SGLangEngine

    async def run() -> dict[int, float]:
        engine = SGLangEngine(SGLangConfig(minilm_dir(), MODEL))
        await engine.start()
        loop = asyncio.get_running_loop()
        out = {}
        for batch, requests, rounds in plan(quick):
            out[batch] = await loop.run_in_executor(
                None, rate, lambda xs: asyncio.run_coroutine_threadsafe(engine.embed(xs), loop).result(), batch,
                requests, rounds)
        await engine.shutdown()
        return out

    return asyncio.run(run())


# --- through the mesh -------------------------------------------------------------------------------------------
def through_mesh(base_url: str, quick: bool) -> dict[str, dict[int, float]]:
    """The mesh's rates through the openai SDK (what users run) and through a light client (``http.client`` on one
    keep-alive connection, the JSON built by orjson): on these 2 cores the SDK's own ~2 ms of CPU per call (httpx,
    pydantic, decoding the vectors) competes with the mesh, and a client on another machine would not."""
    import http.client
    from urllib.parse import urlsplit

    import openai
    import orjson

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=300)

    def light(xs: list[str]) -> object:
        conn.request("POST", "/v1/embeddings", orjson.dumps({"model": MODEL, "input": xs}),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200, body
        return orjson.loads(body)

    try:
        return {"mesh (openai SDK)": {batch: rate(lambda xs: client.embeddings.create(model=MODEL, input=xs), batch,
                                                  requests, rounds) for batch, requests, rounds in plan(quick)},
                "mesh (light client)": {batch: rate(light, batch, requests, rounds)
                                        for batch, requests, rounds in plan(quick)}}
    finally:
        conn.close()


def hf_mesh(quick: bool) -> dict[str, dict[int, float]]:
    from tests.support.mesh import start_mesh

    mesh = start_mesh(workers=1, env={"EMBEDMESH_TRACE_CONSOLE": "0"})
    try:
        return through_mesh(mesh.base_url, quick)
    finally:
        mesh.stop()


def sglang_venv() -> Path | None:
    cache = Path(os.environ.get("EMBEDMESH_CACHE", Path.home() / ".cache" / "embedmesh"))
    venv = Path(os.environ.get("EMBEDMESH_SGLANG_VENV", cache / "venvs" / "sglang-0.5.23"))
    return venv if (venv / ".complete").exists() else None


def sglang_mesh(quick: bool) -> dict[str, dict[int, float]]:
    import tempfile

    from tests.e2e_sglang.conftest import start_sglang_mesh

    mesh = start_sglang_mesh(Path(tempfile.mkdtemp(prefix="bench-sglang-")))
    try:
        return through_mesh(mesh.base_url, quick)
    finally:
        mesh.stop()


def sglang_in_process_via_venv(venv: Path, quick: bool) -> dict[int, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("services", "gateway", "gen/python"))}
    cmd = [str(venv / "bin" / "python"), __file__, "--sglang-in-process", *(["--quick"] if quick else [])]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"sglang in-process run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(lines[-1]).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--engines", default="hf,sglang", help="comma-separated subset of hf,sglang (default: both)")
    p.add_argument("--sglang-in-process", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.sglang_in_process:
        print(json.dumps(sglang_in_process(a.quick)), flush=True)
        return 0
    engines = {e.strip() for e in a.engines.split(",") if e.strip()}
    rows: list[tuple[str, str, dict[int, float] | str]] = []
    if "hf" in engines:
        rows.append(("hf", "in-process", hf_in_process(a.quick)))
        rows.extend(("hf", path, figures) for path, figures in hf_mesh(a.quick).items())
    venv = sglang_venv()
    if "sglang" in engines and venv is None:
        rows.append(("sglang", "-", "skipped: no SGLang venv (bash scripts/sglang_venv.sh)"))
    elif "sglang" in engines and venv is not None:
        rows.append(("sglang", "in-process", sglang_in_process_via_venv(venv, a.quick)))
        rows.extend(("sglang", path, figures) for path, figures in sglang_mesh(a.quick).items())
    print(f"\nall-MiniLM-L6-v2, sentences/s (distinct ~17-token sentences, cache never hit), {os.cpu_count()} cores")
    print(f"{'engine':8} {'path':20} {'batch 1':>10} {'batch 32':>10}   mesh / in-process")
    base: dict[str, dict[int, float]] = {}
    for engine, path, result in rows:
        if isinstance(result, str):
            print(f"{engine:8} {result}")
            continue
        share = ""
        if path == "in-process":
            base[engine] = result
        elif engine in base:
            share = "   " + "  ".join(f"{result[b] / base[engine][b]:4.0%} at {b}" for b in (1, 32))
        print(f"{engine:8} {path:20} {result[1]:10.1f} {result[32]:10.1f}{share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

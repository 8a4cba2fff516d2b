"""Admin RPCs of the vllm worker on the real engine: LoRA load (concurrent loads of one adapter load it once),
generate with it, list, unload; clear KV blocks; sleep/wake answered clearly where vLLM's CPU build has no sleep
mode; engines without admin support answer FAILED_PRECONDITION."""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from embedmesh.core.errors import from_rpc_error
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of, embeds_of, hf_model  # noqa: F401 - fixtures
from tests.e2e_vllm.test_vllm_mesh import TEXT, VENV
from tests.support.lora import save_smol_adapter
from tests.support.mesh import Mesh, start_mesh
from tests.support.worker_generate import worker_generate

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lmesh() -> Iterator[Mesh]:
    if not (VENV / ".complete").exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    # Adapters load only from under the LoRA root: the tests' adapters live in pytest's temporary folders.
    m = start_mesh(engine="vllm", timeout=400, env={"EMBEDMESH_VLLM_ENABLE_LORA": "1",
                                                    "EMBEDMESH_LORA_ROOT": tempfile.gettempdir()},
                   extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real LoRA adapter for SmolLM2, made here with peft (random, non-zero B so it changes the output)."""
    out = tmp_path_factory.mktemp("lora") / "smol-lora"
    save_smol_adapter(out)
    return out


def stub(mesh: Mesh) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(mesh.workers[0]))


def generate(s: Any, lora: str = "") -> str:
    req = worker_pb2.GenerateRequest(request_id=f"g{time.monotonic_ns()}", lora_adapter=lora, segments=[
        worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=[504, 3458, 282, 4649, 314]))])
    req.sampling.max_tokens = 10
    req.sampling.temperature = 0
    return "".join(r.text for r in worker_generate(s, req, timeout=120))


def test_lora_load_once_generate_list_unload(lmesh: Mesh, adapter: Path) -> None:
    async def load_many() -> list[bool]:
        async with grpc.aio.insecure_channel(lmesh.workers[0]) as ch:
            s = worker_pb2_grpc.WorkerServiceStub(ch)
            req = worker_pb2.LoadLoraAdapterRequest(name="smol-lora", path=str(adapter))
            return [r.loaded for r in await asyncio.gather(*[s.LoadLoraAdapter(req, timeout=120) for _ in range(5)])]

    assert sorted(asyncio.run(load_many())) == [False, False, False, False, True], "loaded more than once"
    s = stub(lmesh)
    listed = s.ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), timeout=10)
    # named as the caller names it, under the LoRA root (an admin answer never shows the host's absolute paths)
    under_root = adapter.resolve().relative_to(Path(tempfile.gettempdir()).resolve())
    assert [(a.name, a.path) for a in listed.adapters] == [("smol-lora", str(under_root))]
    base, tuned = generate(s), generate(s, "smol-lora")
    assert base and tuned and tuned != base, "the adapter did not change the output"
    assert s.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name="smol-lora"), timeout=30).unloaded
    assert not s.ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), timeout=10).adapters
    with pytest.raises(grpc.RpcError) as info:
        generate(s, "smol-lora")
    assert from_rpc_error(info.value).field == "model"
    assert from_rpc_error(info.value).reason == "LORA_NOT_LOADED"


LONG = "A long shared system prompt about rivers, mountains and the history of trade routes. " * 20


def test_adapter_as_a_model_through_the_gateway_with_its_own_kv_chain(lmesh: Mesh, adapter: Path,
                                                                       hf_model: Any, embeds_of: Any) -> None:  # noqa: F811
    """Loaded through the public admin route, the adapter is a model: text and prompt_embeds give transformers +
    peft's greedy text; vLLM's KV events for its blocks (they carry the adapter's id) reach the router as the
    adapter's own chain, and the same prompt on the base model adds a second chain instead of matching it."""
    import openai
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from embedmesh.models import ensure_default_model

    r = httpx.post(f"{lmesh.base_url}/v1/load_lora_adapter", timeout=300,
                   json={"lora_name": "gw-lora", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{lmesh.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    models = {m.id: m for m in client.models.list().data}
    assert models["gw-lora"].model_extra["parent"] == MODEL

    _, tok = hf_model
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ensure_default_model()),
                                    str(adapter)).eval()
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=6, do_sample=False)
    expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    text = client.completions.create(model="gw-lora", prompt=TEXT, max_tokens=6, temperature=0).choices[0].text
    assert text == expected
    embeds = client.completions.create(model="gw-lora", prompt="", max_tokens=6, temperature=0,
                                       extra_body={"prompt_embeds": b64_of(embeds_of(TEXT))}).choices[0].text
    assert embeds == expected

    def nodes() -> int:
        with grpc.insecure_channel(str(lmesh.extra["router"])) as ch:
            return router_pb2_grpc.RouterServiceStub(ch).GetIndexStats(router_pb2.GetIndexStatsRequest(),
                                                                       timeout=5).nodes

    def grows(since: int) -> int:
        deadline = time.monotonic() + 15
        while nodes() <= since and time.monotonic() < deadline:
            time.sleep(0.2)
        return nodes() - since

    n0 = nodes()
    client.completions.create(model="gw-lora", prompt=LONG, max_tokens=2, temperature=0)
    added = grows(n0)
    assert added >= 8, "vLLM's blocks of the adapter request did not reach the router"
    n1 = nodes()
    client.completions.create(model="gw-lora", prompt=LONG, max_tokens=2, temperature=0)
    time.sleep(1.0)
    assert nodes() == n1, "the repeated adapter prompt reuses its chain"
    client.completions.create(model=MODEL, prompt=LONG, max_tokens=2, temperature=0)
    assert grows(n1) >= added - 1, "the base model's blocks must form their own chain"
    r = httpx.post(f"{lmesh.base_url}/v1/unload_lora_adapter", json={"lora_name": "gw-lora"}, timeout=120)
    assert r.status_code == 200, r.text


def test_bad_lora_requests(lmesh: Mesh, tmp_path: Path) -> None:
    s = stub(lmesh)
    (tmp_path / "escape").symlink_to("/etc")
    for req, field in ((worker_pb2.LoadLoraAdapterRequest(path="/x"), "name"),
                       (worker_pb2.LoadLoraAdapterRequest(name="x"), "path"),
                       (worker_pb2.LoadLoraAdapterRequest(name="x", path=str(tmp_path)), "path"),
                       (worker_pb2.LoadLoraAdapterRequest(name="x", path="/etc"), "path"),
                       (worker_pb2.LoadLoraAdapterRequest(name="x", path=f"{tmp_path}/../../../etc"), "path"),
                       (worker_pb2.LoadLoraAdapterRequest(name="x", path=str(tmp_path / "escape")), "path")):
        with pytest.raises(grpc.RpcError) as info:
            s.LoadLoraAdapter(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and from_rpc_error(info.value).field == field
    assert generate(s)


def _hits(mesh: Mesh) -> float:
    port = int(mesh.extra["metrics_base"]) + 10
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_clear_kv_blocks_empties_the_prefix_cache(lmesh: Mesh) -> None:
    s = stub(lmesh)
    ids = list(range(1000, 1400))

    def run() -> None:
        req = worker_pb2.GenerateRequest(request_id=f"c{time.monotonic_ns()}", segments=[
            worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=ids))])
        req.sampling.max_tokens = 1
        list(worker_generate(s, req, timeout=120))
        time.sleep(1.0)

    run()
    before = _hits(lmesh)
    run()
    warm = _hits(lmesh)
    assert warm > before, "a repeated prompt should hit the prefix cache"
    assert s.ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(), timeout=30).cleared
    run()
    assert _hits(lmesh) == warm, "after ClearKvBlocks the same prompt found cached blocks"


def test_sleep_is_refused_clearly_on_this_cpu_and_the_worker_keeps_serving(lmesh: Mesh) -> None:
    s = stub(lmesh)
    with pytest.raises(grpc.RpcError) as info:
        s.Sleep(worker_pb2.SleepRequest(level=1), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sleep mode is not available" in info.value.details()
    s.WakeUp(worker_pb2.WakeUpRequest(), timeout=30)
    assert generate(s)


def test_engine_metrics_are_exported(lmesh: Mesh) -> None:
    port = int(lmesh.extra["metrics_base"]) + 10
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "embedmesh_worker_generated_tokens_total"):
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name

"""LoRA adapters through the public API on the hf engine: loaded at run time on one of two workers (admin route,
vLLM's body), listed as a model with its parent, used as `model` for completions (text and prompt_embeds) and chat
with the same greedy text transformers + peft compute, routed only to the worker that holds it, unloaded; bad
loads are 400s naming the field and leave nothing loaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of
from tests.support.lora import save_other_base_adapter, save_smol_adapter
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-root")
    save_smol_adapter(root / "smol-lora")
    (root / "not-an-adapter").mkdir()
    save_other_base_adapter(root / "other-base-lora")  # shapes that cannot fit SmolLM2
    return root


@pytest.fixture(scope="module")
def lmesh(lora_root: Path) -> Iterator[Mesh]:
    m = start_mesh(workers=2, env={"EMBEDMESH_LORA_ROOT": str(lora_root)},
                   extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


@pytest.fixture(scope="module")
def lclient(lmesh: Mesh) -> Any:
    return openai.OpenAI(base_url=f"{lmesh.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def _stats(mesh: Mesh) -> list[tuple[str, int]]:
    out = []
    for port in mesh.worker_ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            stats = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        out.append((info.worker_id, stats.completed_requests))
    return out


def _reference(lora_root: Path, hf_model: Any, n: int = 8) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from embedmesh.models import ensure_default_model

    _, tok = hf_model
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ensure_default_model()),
                                      str(lora_root / "smol-lora")).eval()
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_adapter_as_a_model_end_to_end(lmesh: Mesh, lclient: Any, lora_root: Path, hf_model: Any,
                                       embeds_of: Any) -> None:
    holder = _stats(lmesh)[0][0]
    r = httpx.post(f"{lmesh.base_url}/v1/load_lora_adapter", timeout=300,
                   json={"lora_name": "smol-lora", "lora_path": str(lora_root / "smol-lora"), "workers": [holder]})
    assert r.status_code == 200, r.text
    models = {m.id: m for m in lclient.models.list().data}
    assert models["smol-lora"].model_extra["parent"] == MODEL
    assert models["smol-lora"].model_extra["ready_workers"] == 1

    base = lclient.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0).choices[0].text
    before = dict(_stats(lmesh))
    texts = [lclient.completions.create(model="smol-lora", prompt=TEXT, max_tokens=8, temperature=0)
             for _ in range(3)]
    assert {t.choices[0].text for t in texts} == {_reference(lora_root, hf_model)}
    assert texts[0].model == "smol-lora"
    assert texts[0].choices[0].text != base
    by_embeds = lclient.completions.create(model="smol-lora", prompt="", max_tokens=8, temperature=0,
                                           extra_body={"prompt_embeds": b64_of(embeds_of(TEXT))})
    assert by_embeds.choices[0].text == texts[0].choices[0].text
    chat = lclient.chat.completions.create(model="smol-lora", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
    assert chat.choices[0].message.content
    after = dict(_stats(lmesh))
    # Every adapter request (3 + 1 + 1) ran on the worker holding the adapter.
    others = [w for w in after if w != holder]
    assert after[holder] - before[holder] == 5
    assert all(after[w] == before[w] for w in others)
    # The base model is unaffected after the adapter ran.
    assert lclient.completions.create(model=MODEL, prompt=TEXT, max_tokens=8,
                                      temperature=0).choices[0].text == base

    r = httpx.post(f"{lmesh.base_url}/v1/unload_lora_adapter", json={"lora_name": "smol-lora"}, timeout=120)
    assert r.status_code == 200, r.text
    assert "smol-lora" not in {m.id for m in lclient.models.list().data}
    with pytest.raises(openai.BadRequestError) as e:
        lclient.completions.create(model="smol-lora", prompt=TEXT, max_tokens=2)
    assert e.value.body["param"] == "model"


@pytest.mark.parametrize(("body", "param"), [
    ({"lora_name": "x", "lora_path": "/etc"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "../../etc"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "not-an-adapter"}, "lora_path"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_path": "smol-lora"}, "lora_name"),
    ({"lora_name": MODEL, "lora_path": "smol-lora"}, "lora_name"),
    ({"lora_name": "x", "lora_path": "smol-lora", "workers": ["no-such-worker"]}, "workers"),
    ({"lora_name": "x", "lora_path": "other-base-lora"}, "lora_path"),
])
def test_bad_loads_are_400_naming_the_field(lmesh: Mesh, lclient: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{lmesh.base_url}/v1/load_lora_adapter", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "x" not in {m.id for m in lclient.models.list().data}


def test_a_refused_load_leaves_the_model_as_it_was(lmesh: Mesh, lclient: Any, lora_root: Path,
                                                   hf_model: Any) -> None:
    """After a shape-mismatched adapter was refused on every worker, the base model's text is unchanged and a good
    adapter still loads and gives transformers + peft's text."""
    base = lclient.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0).choices[0].text
    r = httpx.post(f"{lmesh.base_url}/v1/load_lora_adapter", timeout=300,
                   json={"lora_name": "mismatch", "lora_path": "other-base-lora"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "cannot be loaded on this model" in r.json()["error"]["message"]
    assert "mismatch" not in {m.id for m in lclient.models.list().data}
    assert lclient.completions.create(model=MODEL, prompt=TEXT, max_tokens=8,
                                      temperature=0).choices[0].text == base
    r = httpx.post(f"{lmesh.base_url}/v1/load_lora_adapter", timeout=300,
                   json={"lora_name": "after-refusal", "lora_path": "smol-lora"})
    assert r.status_code == 200, r.text
    got = lclient.completions.create(model="after-refusal", prompt=TEXT, max_tokens=8, temperature=0)
    assert got.choices[0].text == _reference(lora_root, hf_model)
    r = httpx.post(f"{lmesh.base_url}/v1/unload_lora_adapter", json={"lora_name": "after-refusal"}, timeout=120)
    assert r.status_code == 200, r.text
    assert lclient.completions.create(model=MODEL, prompt=TEXT, max_tokens=8,
                                      temperature=0).choices[0].text == base


def test_unloading_an_unknown_adapter_is_404(lmesh: Mesh) -> None:
    r = httpx.post(f"{lmesh.base_url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_python_client_lists_loads_and_uses_adapters(lmesh: Mesh, lora_root: Path) -> None:
    import asyncio

    from embedmesh_client import AsyncClient, Client

    with Client(lmesh.preprocessor, timeout=300) as c:
        resp = c.load_lora_adapter("client-lora", "smol-lora")
        assert resp.loaded and len(resp.workers) == 2  # default: every generative worker
        assert [(m.id, m.parent, m.ready_workers) for m in c.list_adapters()] == [("client-lora", MODEL, 2)]
        text = c.complete("client-lora", prompt=TEXT, max_tokens=6, temperature=0, logprobs=1).choices[0]
        assert len(text.logprobs) == 6

    async def stream() -> str:
        async with AsyncClient(lmesh.preprocessor, timeout=300) as ac:
            parts = [m.text async for m in ac.stream_chat("client-lora", [{"role": "user", "content": "Hi"}],
                                                          max_tokens=4, temperature=0)]
            await ac.unload_lora_adapter("client-lora")
            assert await ac.list_adapters() == []
            return "".join(parts)

    assert asyncio.run(stream())


def test_sleep_mode_routes_answer_clearly_on_this_cpu(lmesh: Mesh) -> None:
    """vLLM's /sleep, /wake_up, /is_sleeping: the hf engine has no sleep mode, so /sleep is a clear 400 and nothing
    changes; /is_sleeping answers for every generative worker."""
    r = httpx.post(f"{lmesh.base_url}/sleep?level=1", timeout=60)
    assert r.status_code == 400, r.text
    assert "sleep is not supported by the hf engine" in r.json()["error"]["message"]
    r = httpx.post(f"{lmesh.base_url}/sleep?level=3", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = httpx.get(f"{lmesh.base_url}/is_sleeping", timeout=60)
    assert r.status_code == 200 and r.json() == {"is_sleeping": False, "sleeping_workers": []}
    assert httpx.post(f"{lmesh.base_url}/wake_up", timeout=60).status_code == 400  # nothing to wake: same refusal

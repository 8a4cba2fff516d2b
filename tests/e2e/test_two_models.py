"""Two generative models in one mesh (launcher `--model` repeated): the packaged SmolLM2 and a second folder (the
same weights saved in bfloat16 under another name). Both are listed; each request runs on its model's worker only,
with that model's tokenizer and chat template, and gives the text transformers gives on that folder."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

SECOND = "smol-bf16"
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from embedmesh.models import ensure_default_model

    src = ensure_default_model()
    out = tmp_path_factory.mktemp("models") / SECOND
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def two(second_model: Path) -> Iterator[Mesh]:
    m = start_mesh(workers=1, extra_args=["--model", "default", "--model", str(second_model),
                                          "--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


def _workers(mesh: Mesh) -> dict[str, tuple[str, int]]:
    """model -> (worker id, completed requests), for both workers (ports first and first + 1)."""
    out = {}
    for port in (mesh.worker_ports[0], mesh.worker_ports[0] + 1):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            stats = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
            out[info.model] = (info.worker_id, stats.completed_requests)
    return out


def _reference(folder: Path, n: int = 8) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_each_model_runs_only_on_its_workers(two: Mesh, second_model: Path) -> None:
    from embedmesh.models import ensure_default_model

    client = openai.OpenAI(base_url=f"{two.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    assert {MODEL, SECOND} <= {m.id for m in client.models.list().data}
    before = _workers(two)
    assert set(before) == {MODEL, SECOND}
    a = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0).choices[0].text
    b = [client.completions.create(model=SECOND, prompt=TEXT, max_tokens=8, temperature=0).choices[0].text
         for _ in range(2)]
    chat = client.chat.completions.create(model=SECOND, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content
    assert a == _reference(ensure_default_model())
    assert b == [_reference(second_model)] * 2
    after = _workers(two)
    assert after[MODEL][1] - before[MODEL][1] == 1
    assert after[SECOND][1] - before[SECOND][1] == 3

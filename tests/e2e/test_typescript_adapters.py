"""The TypeScript client with LoRA adapters: dist/models.js prints ListModels (the adapter listed with its base
model as parent, every Model field as the Python client sees it), and dist/complete.js with the adapter's name as
`model` streams the same greedy text as the Python client, which differs from the base model's; an unknown name
is INVALID_ARGUMENT (3) with exit code 1."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from embedmesh_client import Client
from embedmesh_client.errors import EmbedmeshClientError

from embedmesh.tensor.v1 import tensor_pb2
from tests.e2e.conftest import HIDDEN, MODEL
from tests.support.lora import save_smol_adapter
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "clients" / "typescript" / "dist"
ADAPTER = "ts-lora"
TEXT = "The capital of France is"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ts-lora-root")
    save_smol_adapter(root / "smol-lora")
    return root


@pytest.fixture(scope="module")
def amesh(lora_root: Path) -> Iterator[Mesh]:
    """A one-worker mesh (no API keys, so the admin call needs none) with the adapter loaded by the Python
    client's load_lora_adapter (InferenceService.LoadLoraAdapter)."""
    assert (DIST / "models.js").exists() and (DIST / "complete.js").exists(), \
        "build the TypeScript client first: make ts-client"
    m = start_mesh(workers=1, env={"EMBEDMESH_LORA_ROOT": str(lora_root)})
    try:
        with Client(m.preprocessor, timeout=300) as c:
            resp = c.load_lora_adapter(ADAPTER, "smol-lora")
            assert resp.loaded and len(resp.workers) == 1
        yield m
    finally:
        m.stop()


def _node(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["node", str(DIST / script), *args], capture_output=True, text=True, timeout=timeout)


def _tensor_file(embeds_of: Any, tmp_path: Path, text: str = TEXT) -> tuple[np.ndarray, Path]:
    emb = embeds_of(text).numpy().astype("<f4")
    path = tmp_path / "prompt.f32"
    path.write_bytes(emb.tobytes())
    return emb, path


def _complete_js(mesh: Mesh, model: str, emb: np.ndarray, path: Path) -> subprocess.CompletedProcess[str]:
    return _node("complete.js", mesh.preprocessor, model, str(path), str(emb.shape[0]), str(emb.shape[1]),
                 str(MAX_TOKENS))


def test_models_js_lists_the_adapter_with_its_parent(amesh: Mesh) -> None:
    r = _node("models.js", amesh.preprocessor)
    assert r.returncode == 0, r.stderr
    models = {m["id"]: m for m in json.loads(r.stdout)["models"]}
    assert models[ADAPTER]["parent"] == MODEL
    assert models[MODEL]["parent"] == ""
    assert models[ADAPTER]["readyWorkers"] == 1
    assert models[ADAPTER]["hiddenSize"] == HIDDEN and models[ADAPTER]["task"] == "generate"
    # Every field of the proto's Model, as the Python client reads it.
    with Client(amesh.preprocessor) as c:
        expected = {m.id: m for m in c.list_models()}
    assert set(models) == set(expected)
    for mid, m in models.items():
        e = expected[mid]
        assert m == {"id": e.id, "parent": e.parent, "hiddenSize": e.hidden_size,
                     "maxContextTokens": e.max_context_tokens, "dtype": tensor_pb2.DataType.Name(e.dtype),
                     "engines": list(e.engines), "task": e.task, "embeddingSize": e.embedding_size,
                     "readyWorkers": e.ready_workers, "created": e.created}, mid


def test_complete_js_with_the_adapter_as_model(amesh: Mesh, embeds_of: Any, tmp_path: Path) -> None:
    emb, path = _tensor_file(embeds_of, tmp_path)
    r = _complete_js(amesh, ADAPTER, emb, path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    base = _complete_js(amesh, MODEL, emb, path)
    assert base.returncode == 0, base.stderr
    base_text = json.loads(base.stdout)["text"]
    with Client(amesh.preprocessor, timeout=300) as c:
        expected = c.complete(ADAPTER, embeds=emb, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        expected_base = c.complete(MODEL, embeds=emb, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    assert out["text"] == expected and out["text"]
    assert base_text == expected_base
    assert out["text"] != base_text, "the adapter did not change the output"
    assert out["deltas"] >= 2, "the completion was not streamed"
    assert out["usage"]["promptTokens"] == emb.shape[0]


def test_unknown_adapter_is_invalid_argument(amesh: Mesh, embeds_of: Any, tmp_path: Path) -> None:
    emb, path = _tensor_file(embeds_of, tmp_path)
    with Client(amesh.preprocessor) as c, pytest.raises(EmbedmeshClientError) as e:
        c.complete("no-such-lora", embeds=emb, max_tokens=2, temperature=0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "model"
    r = _complete_js(amesh, "no-such-lora", emb, path)
    assert r.returncode == 1
    err = json.loads(r.stderr.strip().splitlines()[-1])
    assert err["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert "no-such-lora" in err["details"]

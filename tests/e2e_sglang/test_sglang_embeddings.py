"""/v1/embeddings through a mesh whose embedding worker is SGLang (real sglang==0.5.23 on the CPU), with the
official openai SDK, plus the worker's Embed over gRPC.

SGLang pools BERT models with the [CLS] token (``sglang/srt/models/bert.py``); all-MiniLM-L6-v2 was trained with
mean pooling. So the SGLang worker's vectors equal CLS-pooled transformers outputs, not sentence-transformers':
the test pins both facts and prints the cosine to the hf worker's vectors (0.4-0.6 on these sentences).
"""

from __future__ import annotations

import base64
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.models.minilm import minilm_dir
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e_sglang.conftest import MODEL, SGLangMesh

pytestmark = pytest.mark.e2e

TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def transformers_model() -> Any:
    import torch
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        minilm_dir())


def pooled(transformers_model: Any, texts: list[str], mode: str) -> np.ndarray:
    import torch

    model, tok = transformers_model
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if mode == "cls":
        v = hidden[:, 0]
    else:
        m = batch["attention_mask"].unsqueeze(-1).float()
        v = (hidden * m).sum(1) / m.sum(1)
    return torch.nn.functional.normalize(v, dim=1).numpy()


def test_sdk_float_and_base64(client: Any, transformers_model: Any) -> None:
    as_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    as_b64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    floats = np.array([d.embedding for d in as_float.data], np.float32)
    b64 = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in as_b64.data])
    np.testing.assert_array_equal(floats, b64)
    assert [d.index for d in as_float.data] == [0, 1, 2] and floats.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)
    _, tok = transformers_model
    assert as_float.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)


def test_sglang_pools_with_cls_not_the_trained_mean(client: Any, transformers_model: Any) -> None:
    got = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data], np.float32)
    np.testing.assert_allclose(got, pooled(transformers_model, TEXTS, "cls"), atol=1e-5)
    cosine = (got * pooled(transformers_model, TEXTS, "mean")).sum(1)
    print(f"cosine(sglang, hf/sentence-transformers) per sentence: {np.round(cosine, 3).tolist()}")
    assert (cosine < 0.9).all(), "SGLang now pools like the model was trained; update the docs and this test"


def test_token_ids_equal_text(client: Any, transformers_model: Any) -> None:
    _, tok = transformers_model
    ids = tok(TEXTS[0])["input_ids"]
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
    np.testing.assert_allclose(by_text, by_ids, atol=1e-6)


def test_repeated_input_on_the_worker_gives_the_same_vector(sglang_mesh: SGLangMesh) -> None:
    # Straight to the worker (the preprocessor's cache would answer the repeat): with SGLang's radix cache on,
    # the second call would be computed from cached prefix states and come back wrong.
    req = worker_pb2.EmbedRequest(inputs=[worker_pb2.EmbedInput(text=t) for t in TEXTS + TEXTS[:1]])
    with grpc.insecure_channel(sglang_mesh.worker) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        info = stub.GetInfo(worker_pb2.GetInfoRequest())
        first = tensors.to_numpy(stub.Embed(req, timeout=60).embeddings)[0]
        second = tensors.to_numpy(stub.Embed(req, timeout=60).embeddings)[0]
    assert info.engine == "sglang" and info.task == worker_pb2.MODEL_TASK_EMBED and info.embedding_size == 384
    np.testing.assert_allclose(first, second, atol=1e-6)
    np.testing.assert_allclose(first[0], first[3], atol=1e-6)


def test_concurrent_requests(client: Any, transformers_model: Any) -> None:
    # Texts no earlier request sent (the per-input cache must not answer them), each compared with transformers'
    # own output computed here, so every concurrent answer is the engine's own and correct.
    run = uuid.uuid4().hex[:8]
    texts = [f"concurrent sentence number {i} of run {run}" for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t).data[0].embedding, texts))
    np.testing.assert_allclose(np.array(results, np.float32), pooled(transformers_model, texts, "cls"), atol=1e-5)


BAD = [
    ("empty string", {"input": ""}, "input"),
    ("token id outside the vocabulary", {"input": [[101, 10**6]]}, "input"),
    ("too many tokens, second input", {"input": ["fine", "word " * 600]}, "input[1]"),
    ("dimensions not supported", {"input": "hi", "dimensions": 128}, "dimensions"),
    ("unknown encoding_format", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400(sglang_mesh: SGLangMesh, name: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{sglang_mesh.base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{sglang_mesh.base_url}/v1/embeddings", json={"model": MODEL, "input": "fine"}, timeout=60)
    assert ok.status_code == 200

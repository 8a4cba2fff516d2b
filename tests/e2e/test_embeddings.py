"""/v1/embeddings through the real mesh (hf-embed worker, all-MiniLM-L6-v2) with the official openai SDK."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

EMBED = "all-MiniLM-L6-v2"
TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def reference() -> Any:
    from sentence_transformers import SentenceTransformer

    from embedmesh.models.minilm import minilm_dir

    return SentenceTransformer(str(minilm_dir()), device="cpu")


def test_float_and_base64_encodings_equal_the_model(mesh: Any, client: Any, reference: Any) -> None:
    import base64

    expected = reference.encode(TEXTS, convert_to_numpy=True)
    # The SDK asks for base64 by itself and decodes it when no encoding_format is given.
    decoded_by_sdk = client.embeddings.create(model=EMBED, input=TEXTS)
    as_float = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    as_b64 = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="base64")
    raw = httpx.post(f"{mesh.base_url}/v1/embeddings", json={"model": EMBED, "input": TEXTS}, timeout=60).json()
    assert isinstance(raw["data"][0]["embedding"][0], float), "float is the default on the wire"
    b64_rows = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_b64.data]
    for rows in ([d.embedding for d in decoded_by_sdk.data], [d.embedding for d in as_float.data], b64_rows,
                 [d["embedding"] for d in raw["data"]]):
        np.testing.assert_allclose(np.array(rows, dtype=np.float32), expected, atol=1e-5)
    assert [d.index for d in as_float.data] == [0, 1, 2]
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert as_float.usage.prompt_tokens == tokens and as_float.usage.total_tokens == tokens


def test_single_string_and_token_ids(client: Any, reference: Any) -> None:
    one = client.embeddings.create(model=EMBED, input=TEXTS[0])
    ids = reference.tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=EMBED, input=ids)
    by_lists = client.embeddings.create(model=EMBED, input=[ids, ids])
    np.testing.assert_allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-5)
    assert len(by_lists.data) == 2


def test_repeated_input_is_served_from_the_cache(mesh: Any, client: Any) -> None:
    import grpc

    from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

    def served() -> int:
        with grpc.insecure_channel(mesh.extra["embed_worker"]) as ch:
            return worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest()).completed_requests

    text = ["a sentence nobody embedded before in this session"]
    first = client.embeddings.create(model=EMBED, input=text)
    before = served()
    again = client.embeddings.create(model=EMBED, input=text)
    assert served() == before, "the repeated input reached the worker"
    assert again.data[0].embedding == first.data[0].embedding
    assert again.usage.prompt_tokens == first.usage.prompt_tokens


BAD = [
    ("empty string", {"input": ""}, "input"),
    ("empty list", {"input": []}, "input"),
    ("empty string in a list", {"input": ["ok", ""]}, "input[1]"),
    ("negative token id", {"input": [[1, -5]]}, "input"),
    ("token id outside the vocabulary", {"input": [[101, 10**7]]}, "input"),
    ("too many tokens", {"input": ["word " * 600]}, "input"),
    ("too many tokens, second input", {"input": ["fine", "word " * 600]}, "input[1]"),
    ("unknown encoding_format", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("too many inputs", {"input": ["x"] * 2049}, "input"),
    ("dimensions not supported", {"input": "hi", "dimensions": 128}, "dimensions"),
    ("dimensions larger than the model", {"input": "hi", "dimensions": 4096}, "dimensions"),
    ("generative model", {"input": "hi", "model": MODEL}, "model"),
    ("wrong input type", {"input": 42}, "input"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400(mesh: Any, name: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/embeddings", json={"model": EMBED, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{mesh.base_url}/v1/embeddings", json={"model": EMBED, "input": "fine"}, timeout=60)
    assert ok.status_code == 200


def test_completions_on_the_embedding_model_are_refused(mesh: Any) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/completions", json={"model": EMBED, "prompt": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"

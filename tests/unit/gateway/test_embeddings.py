"""gateway/embeddings.py: ``embed_request`` (an OpenAI body -> EmbedRequest and the response's encoding) and the
``/v1/embeddings`` route through a bare app with a scripted stub — vectors as float lists or base64 of little-endian
float32, usage, a bad body's 400 before any call, the service's refusal mapped."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.gateway import embeddings
from embedmesh.gateway.embeddings import embed_request
from embedmesh.gateway.errors import ApiError
from embedmesh.inference.v1 import inference_pb2 as ipb
from tests.unit.gateway.conftest import FakeStub, bare_gateway, route_client, rpc_error

VECTORS = np.array([[0.5, -1.25, 3.0], [1e-3, 0.0, -2.5]], dtype=np.float32)
ANSWER = ipb.EmbedResponse(model="emb", embeddings=tensors.from_numpy(VECTORS),
                           usage=common_pb2.Usage(prompt_tokens=6, total_tokens=6))


def client(answer: Any = ANSWER) -> tuple[Any, FakeStub]:
    gw = bare_gateway(request_timeout_seconds=17)
    gw.stub = FakeStub(Embed=answer)
    return route_client(embeddings.routes(gw)), gw.stub


@pytest.mark.parametrize(("body", "expected", "fmt"), [
    ({"model": "e", "input": "hi"}, ipb.EmbedRequest(model="e", inputs=[ipb.EmbedInput(text="hi")]), "float"),
    ({"model": "e", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 2},
     ipb.EmbedRequest(model="e", inputs=[ipb.EmbedInput(text="a"), ipb.EmbedInput(text="b")], dimensions=2),
     "base64"),
    ({"model": "e", "input": [1, 2, 3], "encoding_format": None},
     ipb.EmbedRequest(model="e", inputs=[ipb.EmbedInput(token_ids=ipb.TokenIds(ids=[1, 2, 3]))]), "float"),
    ({"model": "e", "input": [[1], [2, 3]], "user": "u"},
     ipb.EmbedRequest(model="e", inputs=[ipb.EmbedInput(token_ids=ipb.TokenIds(ids=[1])),
                                         ipb.EmbedInput(token_ids=ipb.TokenIds(ids=[2, 3]))]), "float"),
])
def test_embed_request_maps_every_input_form(body: dict[str, Any], expected: ipb.EmbedRequest, fmt: str) -> None:
    req, got_fmt = embed_request(body)
    assert (req, got_fmt) == (expected, fmt)
    assert req.HasField("dimensions") == ("dimensions" in body)


def test_float_vectors_and_usage() -> None:
    http, stub = client()
    r = http.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == "emb"
    assert out["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert [d["index"] for d in out["data"]] == [0, 1] and {d["object"] for d in out["data"]} == {"embedding"}
    assert np.array([d["embedding"] for d in out["data"]], dtype=np.float32).tolist() == VECTORS.tolist()
    assert stub.calls == [("Embed", ipb.EmbedRequest(model="emb", inputs=[ipb.EmbedInput(text="a"),
                                                                          ipb.EmbedInput(text="b")]), 17)]


def test_base64_vectors_are_little_endian_float32() -> None:
    http, _ = client()
    out = http.post("/v1/embeddings", json={"model": "emb", "input": "a", "encoding_format": "base64"}).json()
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in out["data"]]
    assert np.array_equal(np.stack(rows), VECTORS)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "x"}, "model", "model: is required (an embedding model; see GET /v1/models)"),
    ({"model": "e", "input": []}, "input", "input: must not be empty"),
    ({"model": "e", "input": "x", "dimensions": 0}, "dimensions", "dimensions: must be a positive integer"),
    ({"model": "e", "input": [2**40]}, "input", "input: token ids must fit in int32"),
])
def test_a_bad_body_is_a_400_before_any_call(body: dict[str, Any], param: str, message: str) -> None:
    http, stub = client()
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
    assert stub.calls == []
    with pytest.raises(ApiError):
        embed_request(body)


def test_the_services_refusal_is_mapped_with_its_field() -> None:
    http, _ = client(rpc_error(InvalidArgument("dimensions: the model's size is 3, got 8", field="dimensions",
                                               reason="DIMENSIONS")))
    r = http.post("/v1/embeddings", json={"model": "emb", "input": "a", "dimensions": 8})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "dimensions: the model's size is 3, got 8", "type": "invalid_request_error",
        "param": "dimensions", "code": "dimensions"}

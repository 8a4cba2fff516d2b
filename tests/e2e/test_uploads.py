"""Upload an embeddings tensor once, use it by id (as a prompt, as a shared prefix, in chat), the decode cache that
makes a repeated prompt_embeds payload skip decoding, uploads validated at upload time, and a cache API through which
no client can change what another request computes."""

from __future__ import annotations

import base64
from typing import Any

import blake3
import grpc
import httpx
import numpy as np
import pytest

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core.errors import from_rpc_error
from embedmesh.services.encoder_cache.keys import payload_key
from embedmesh.tensor.v1 import tensor_pb2
from tests.e2e.conftest import HIDDEN, MODEL, b64_of

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


def upload(client: Any, tensor: Any, **kw: Any) -> dict[str, Any]:
    return client.post("/prompt_embeds", body={"data": b64_of(tensor), **kw}, cast_to=object)


def stats(mesh: Any) -> dict[str, cache_pb2.TierStats]:
    with grpc.insecure_channel(mesh.preprocessor) as ch:
        r = cache_pb2_grpc.EncoderCacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=10)
    return {t.tier: t for t in r.tiers}


def test_upload_once_then_complete_by_id(client: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT)
    up = upload(client, emb)
    assert up["id"].startswith("emb-") and up["shape"] == list(emb.shape) and up["dtype"] == "float32"
    again = upload(client, emb)["id"]
    assert again != up["id"] and len(again) == len(up["id"]) == 4 + 32, "ids are random, never content hashes"
    by_text = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0)
    by_id = client.completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0,
                                      extra_body={"prompt_embeds": {"id": up["id"]}})
    assert by_id.choices[0].text == by_text.choices[0].text
    assert by_id.usage.prompt_tokens == emb.shape[0]


def test_prefix_by_id_is_prepended_to_each_prompt(client: Any, embeds_of: Any) -> None:
    head, tail = "The capital of", " France is"
    up = upload(client, embeds_of(head))
    whole = client.completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0,
                                      extra_body={"prompt_embeds": b64_of(embeds_of(head + tail))})
    split = client.completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0,
                                      extra_body={"prompt_embeds": b64_of(embeds_of(tail)),
                                                  "prompt_embeds_prefix": {"id": up["id"]}})
    assert split.choices[0].text == whole.choices[0].text


def test_chat_part_by_id(client: Any, embeds_of: Any) -> None:
    system = "You are a terse geography teacher."
    up = upload(client, embeds_of(system))
    q = [{"role": "user", "content": "What is the capital of France?"}]
    by_text = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                             messages=[{"role": "system", "content": system}, *q])
    by_id = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": [{"type": "prompt_embeds", "id": up["id"]}]}, *q])
    assert by_id.choices[0].message.content == by_text.choices[0].message.content


def test_unknown_or_deleted_id_is_a_404_naming_the_field(mesh: Any, client: Any, embeds_of: Any) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "", "prompt_embeds": {"id": "emb-nope"}})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "prompt_embeds"
    up = upload(client, embeds_of("to be deleted"))
    assert httpx.get(f"{mesh.base_url}/v1/prompt_embeds/{up['id']}").json()["present"] is True
    assert httpx.delete(f"{mesh.base_url}/v1/prompt_embeds/{up['id']}").status_code == 200
    assert httpx.get(f"{mesh.base_url}/v1/prompt_embeds/{up['id']}").status_code == 404
    r = httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "prompt_embeds", "id": up["id"]}]}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "messages[0].content[0]"


@pytest.mark.parametrize(
    "body,param",
    [({"data": "%%%"}, "data"), ({"data": "aGVsbG8="}, "data"), ({}, "data"),
     ({"data": "aGVsbG8=", "ttl_seconds": 0}, "ttl_seconds"),
     ({"data": "aGVsbG8=", "ttl_seconds": 2**40}, "ttl_seconds"),
     ({"data": "aGVsbG8=", "ttl_seconds": 31 * 86400}, "ttl_seconds"),
     ({"data": "aGVsbG8=", "ttl_seconds": 1.5}, "ttl_seconds")],
)
def test_bad_uploads_are_400s(mesh: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_big_upload_refused_by_its_header_is_a_400_every_time(mesh: Any) -> None:
    # 14 MB: the gateway is still writing chunks when the cache refuses the header's ttl; that refusal (not a
    # failed write, which grpc.aio would report as INTERNAL: a 500) is what comes back, every time.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(torch.from_numpy(np.random.default_rng(0).standard_normal((6000, HIDDEN), dtype=np.float32)), buf)
    data = base64.b64encode(buf.getvalue()).decode()
    for _ in range(8):
        r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", json={"data": data, "ttl_seconds": 31 * 86400},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "ttl_seconds"


def test_repeated_payload_is_decoded_once(mesh: Any, client: Any, embeds_of: Any) -> None:
    payload = b64_of(embeds_of("A fresh prompt never sent before, about penguins"))
    before = stats(mesh)["l1"]
    a = client.completions.create(model=MODEL, prompt="", max_tokens=4, temperature=0,
                                  extra_body={"prompt_embeds": payload})
    mid = stats(mesh)["l1"]
    b = client.completions.create(model=MODEL, prompt="", max_tokens=4, temperature=0,
                                  extra_body={"prompt_embeds": payload})
    after = stats(mesh)["l1"]
    assert a.choices[0].text == b.choices[0].text
    assert mid.misses == before.misses + 1 and mid.entries == before.entries + 1
    assert after.hits == mid.hits + 1 and after.misses == mid.misses


def _tensor_with(value: float) -> Any:
    import torch

    t = torch.randn(4, HIDDEN)
    t[1, 7] = value
    return t


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_upload_is_a_400_at_upload_time(mesh: Any, value: float) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", json={"data": b64_of(_tensor_with(value))}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "data" and "prompt_embeds" in err["message"] and "NaN or Inf" in err["message"]


@pytest.mark.parametrize("make,rule", [
    (lambda t: t.to(__import__("torch").int32), "float32"),
    (lambda t: t.reshape(1, 1, 4, HIDDEN), "2-D"),
    (lambda t: t[:0], "no rows"),
], ids=["integer", "rank 4", "zero rows"])
def test_model_free_rules_apply_at_upload(mesh: Any, make: Any, rule: str) -> None:
    import torch

    r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", json={"data": b64_of(make(torch.randn(4, HIDDEN)))},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "data" and rule in r.json()["error"]["message"]


def test_ttl_out_of_range_message_names_the_bounds(mesh: Any, embeds_of: Any) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", timeout=30,
                   json={"data": b64_of(embeds_of(TEXT)), "ttl_seconds": 2**40})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "ttl_seconds: must be between 1 and 2592000 seconds (30 days), got " + \
        str(2**40)


def _cache_put(mesh: Any, header: cache_pb2.PutHeader, data: bytes) -> grpc.RpcError | cache_pb2.PutResponse:
    with grpc.insecure_channel(mesh.preprocessor) as ch:
        stub = cache_pb2_grpc.EncoderCacheServiceStub(ch)
        try:
            return stub.Put(iter([cache_pb2.PutRequest(header=header), cache_pb2.PutRequest(chunk=data)]), timeout=30)
        except grpc.RpcError as e:
            return e


def test_nothing_a_client_sends_through_the_cache_api_changes_what_another_request_computes(
    mesh: Any, client: Any, embeds_of: Any
) -> None:
    """A victim sends a prompt_embeds payload; the attacker knows the payload (so it can compute every key the
    server derives from it, old format and new, for every model dtype) and writes NaN or other rows under those
    keys through the public cache API, before and after the victim's first request. Every such write is refused;
    the victim's greedy text never changes."""
    victim = b64_of(embeds_of("The largest planet of the solar system is"))
    raw = base64.b64decode(victim)
    digest16 = blake3.blake3(raw).hexdigest(16)
    keys = []
    for dtype in (tensor_pb2.DATA_TYPE_FP32, tensor_pb2.DATA_TYPE_FP16, tensor_pb2.DATA_TYPE_BF16):
        keys.append(payload_key(f"payload:{dtype}:{HIDDEN}", raw))  # how the server keys validated rows now
        keys.append(f"payload:{dtype}:{HIDDEN}:{digest16}")  # and how it did before key spaces existed
        keys.append("v1:" + keys[-1])
    nan_rows = np.full((9, HIDDEN), np.nan, np.float32)
    other_rows = np.random.default_rng(3).standard_normal((9, HIDDEN), dtype=np.float32)

    def attack() -> None:
        for key in keys:
            for rows in (nan_rows, other_rows):
                header = cache_pb2.PutHeader(key=key, dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(rows.shape))
                r = _cache_put(mesh, header, rows.tobytes())
                assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert from_rpc_error(r).field == "header.key"  # type: ignore[arg-type]
        # A plain name is accepted only with valid rows, and only in the attacker's own namespace.
        for name in (digest16, keys[0].rsplit(":", 1)[1]):
            r = _cache_put(mesh, cache_pb2.PutHeader(key=name, dtype=tensor_pb2.DATA_TYPE_FP32, shape=[9, HIDDEN]),
                           nan_rows.tobytes())
            assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert from_rpc_error(r).reason == "NON_FINITE"  # type: ignore[arg-type]
            r = _cache_put(mesh, cache_pb2.PutHeader(key=name, dtype=tensor_pb2.DATA_TYPE_FP32, shape=[9, HIDDEN]),
                           other_rows.tobytes())
            assert isinstance(r, cache_pb2.PutResponse) and r.key == name

    def victim_text() -> str:
        r = client.completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0,
                                      extra_body={"prompt_embeds": victim})
        return r.choices[0].text

    attack()  # before the server ever saw the payload
    first = victim_text()
    attack()  # after its rows are cached
    assert victim_text() == first
    by_text = client.completions.create(model=MODEL, prompt="The largest planet of the solar system is",
                                        max_tokens=8, temperature=0)
    assert first == by_text.choices[0].text, "the victim's result is the model's own answer"

"""Upload an embeddings tensor once, use it by id (as a prompt, as a shared prefix, in chat), and the decode cache
that makes a repeated prompt_embeds payload skip decoding."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of

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
    assert upload(client, emb)["id"] == up["id"], "ids are content hashes"
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
     ({"data": "aGVsbG8=", "ttl_seconds": 0}, "ttl_seconds")],
)
def test_bad_uploads_are_400s(mesh: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


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

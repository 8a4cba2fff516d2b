"""The default set as containers only: router, hf and hf-embed workers, preprocessor and gateway from the services
and worker-hf images on an internal podman network of their own (no route out of it), the gateway also on a second
network that publishes its REST port on 127.0.0.1 (the commands docs/deployment.md gives for one host), and the
image encode service from the worker-hf image, which the preprocessor calls on an image cache miss. A completion
from ``prompt_embeds`` (built by the client from the model's own embedding layer, as vLLM's docs tell clients to)
equals the completion of the same prompt as text, both served by the containers; /v1/embeddings equals
sentence-transformers on the host; scikit-image's cat, sent as a chat image part, is answered with a cat and
encoded once by the encode container."""

from __future__ import annotations

import base64
import importlib.metadata
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.conftest import MODEL, b64_of
from tests.images.conftest import USER_ID, Containers, image, podman

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, Containers]]:
    services, worker_hf = image("services"), image("worker-hf")
    c = Containers()
    try:
        net = c.network(internal=True)
        edge = c.network()
        c.start(services, "python3", "-m", "embedmesh.services.router.main", "--host", "0.0.0.0", "--port", "50081",
                alias="router", networks=(net,))
        c.start(worker_hf, "--host", "0.0.0.0", "--port", "50061", "--engine", "hf", "--model", "default",
                "--routers", "router:50081", "--advertise", "worker:50061", alias="worker", networks=(net,))
        c.start(worker_hf, "--host", "0.0.0.0", "--port", "50091", "--engine", "hf-embed", alias="worker-embed",
                networks=(net,))
        c.start(worker_hf, "-m", "embedmesh.services.image_encoder.main", "--host", "0.0.0.0", "--port", "50111",
                "--metrics-port", "9100", entrypoint="python3", alias="image-encoder", networks=(net,))
        # The services image turns images off (no torch in it); with an encode service it takes them again.
        c.start(services, "python3", "-m", "embedmesh.services.preprocessor.main", "--host", "0.0.0.0",
                "--port", "50051", "--workers", "worker:50061,worker-embed:50091", "--routers", "router:50081",
                "--image-encoder", "efficientnet-lite0", "--image-encoder-address", "image-encoder:50111",
                alias="preprocessor", networks=(net,))
        gw = c.start(services, "python3", "-m", "embedmesh.gateway.main", "--host", "0.0.0.0", "--port", "8000",
                     "--preprocessor", "preprocessor:50051", alias="gateway", networks=(net, edge), publish=(8000,))
        base = f"http://127.0.0.1:{c.host_port(gw, 8000)}"
        health = _wait_healthy(base, c, 240)
        assert {s["service"] for s in health["services"]} >= {"gateway", "preprocessor", "worker", "router"}, health
        for name in c.names:
            assert c.pid1_uid(name) == USER_ID, name
        yield base, c
    finally:
        c.close()


def _wait_healthy(base: str, c: Containers, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: object = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=3) as r:
                last = json.loads(r.read())
                if isinstance(last, dict) and last.get("status") == "ok":
                    return last
        except OSError as e:
            last = e
        stopped = [n for n in c.names if not c.running(n)]
        if stopped:
            pytest.fail(f"containers exited: {stopped}:\n" + "\n".join(c.logs(n)[-2000:] for n in stopped))
        time.sleep(1)
    logs = "\n".join(f"--- {n}\n{c.logs(n)[-1500:]}" for n in c.names)
    pytest.fail(f"the containerized mesh was not healthy after {timeout}s (last: {last}):\n{logs}")


@pytest.fixture(scope="module")
def embeds_of(smollm: Any) -> Any:
    """text -> the embedding-layer rows of its token ids, from the host's copy of the same default model."""
    import torch

    model, tok = smollm

    def make(text: str) -> torch.Tensor:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            return model.get_input_embeddings()(ids).squeeze(0)

    return make


def _complete(base: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(
        {"model": MODEL, "temperature": 0, "max_tokens": 12, **body}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def test_prompt_embeds_through_the_containers_equal_the_text_prompt(gateway: tuple[str, Containers],
                                                                    embeds_of: Any) -> None:
    base, _ = gateway
    emb = embeds_of(TEXT)
    by_text = _complete(base, {"prompt": TEXT})
    by_embeds = _complete(base, {"prompt": "", "prompt_embeds": b64_of(emb)})
    assert by_text["choices"][0]["text"], "the model produced no text"
    assert by_embeds["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_embeds["usage"]["prompt_tokens"] == emb.shape[0]
    assert by_embeds["usage"]["completion_tokens"] == 12


def test_the_models_list_names_the_baked_in_models(gateway: tuple[str, Containers]) -> None:
    base, _ = gateway
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        models = json.loads(r.read())["data"]
    by_id = {m["id"]: m for m in models}
    assert set(by_id) == {MODEL, "all-MiniLM-L6-v2"}
    assert by_id[MODEL]["ready_workers"] == by_id["all-MiniLM-L6-v2"]["ready_workers"] == 1
    assert by_id["all-MiniLM-L6-v2"]["task"] == "embed"


def test_structured_output_runs_in_the_worker_image(gateway: tuple[str, Containers]) -> None:
    # The image leaves out triton (GPU kernels only): xgrammar's constrained decoding must still work on the CPU.
    base, _ = gateway
    text = _complete(base, {"prompt": "A code:", "max_tokens": 10,
                            "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})["choices"][0]["text"]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
    out = _complete(base, {"prompt": "A JSON object:", "max_tokens": 60, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out["choices"][0]["text"]), dict)


def test_embeddings_through_the_containers_equal_the_model(gateway: tuple[str, Containers]) -> None:
    from sentence_transformers import SentenceTransformer

    from embedmesh.models.minilm import minilm_dir

    base, _ = gateway
    texts = ["The cat sits on the mat.", "Paris is the capital of France."]
    req = urllib.request.Request(f"{base}/v1/embeddings", data=json.dumps(
        {"model": "all-MiniLM-L6-v2", "input": texts}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        rows = [d["embedding"] for d in json.loads(r.read())["data"]]
    expected = SentenceTransformer(str(minilm_dir()), device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(np.array(rows, dtype=np.float32), expected, atol=1e-5)


def _encodes(c: Containers) -> float:
    """The encode container's ``embedmesh_image_encodes_total`` (its /metrics, read inside it: the internal network
    publishes nothing)."""
    name = next(n for n in c.names if "-image-encoder-" in n)
    r = podman("exec", name, "python3", "-c", "import urllib.request as u; "
               "print(u.urlopen('http://127.0.0.1:9100/metrics', timeout=10).read().decode())")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("embedmesh_image_encodes_total"))


def test_a_chat_image_is_encoded_by_the_encoder_container_once_and_answered(gateway: tuple[str, Containers]) -> None:
    base, c = gateway
    dist = importlib.metadata.distribution("scikit-image")
    png = Path(str(dist.locate_file("skimage/data/chelsea.png"))).read_bytes()
    body = {"model": MODEL, "temperature": 0, "max_tokens": 12, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": "What animal is in the picture?"}]}]}

    def ask() -> str:
        req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as r:
            return str(json.loads(r.read())["choices"][0]["message"]["content"])

    before = _encodes(c)
    answer = ask()
    assert re.search(r"\b(cat|cats|kitten|kitty|tabby|feline)\b", answer, re.IGNORECASE), answer
    assert ask() == answer  # greedy, the same rows
    assert _encodes(c) - before == 1, "the repeat came from the preprocessor's cache, not a second encode"

"""The image encode service as its own process (``--image-encoders 1``) on an echo mesh, through the openai SDK:
scikit-image's cat becomes exactly the rows the in-process encoder gives it (the same encoder identity, so the same
cache key; the same number of prompt positions), a repeated image is not encoded again (the service's own counter),
and once the encode service is killed a new image is a 503 naming the encoder while text and cached images are
still served.

The worker is the echo engine (hidden size 576, as SmolLM2): it answers "x" per token, so ``usage.prompt_tokens``
is exactly the positions the worker was given."""

from __future__ import annotations

import base64
import importlib.metadata
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from tests.e2e.conftest import b64_of
from tests.support.mesh import Mesh, free_port, start_mesh

pytestmark = pytest.mark.e2e
pytest.importorskip("efficientnet_lite_pytorch")


def photo(name: str) -> Path:
    return Path(str(importlib.metadata.distribution("scikit-image").locate_file(f"skimage/data/{name}")))


def image_part(name: str) -> dict[str, Any]:
    data = photo(name).read_bytes()
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


@pytest.fixture(scope="module")
def emesh() -> Iterator[Mesh]:
    port = free_port()
    m = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0"},
                   extra_args=["--image-encoders", "1", "--image-encoder-port", str(port)])
    try:
        m.extra["model"] = httpx.get(f"{m.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        m.extra["encoder"] = f"127.0.0.1:{port}"
        yield m
    finally:
        m.stop()


def info(mesh: Mesh, model: str = "") -> imageencoder_pb2.GetInfoResponse:
    with grpc.insecure_channel(mesh.extra["encoder"]) as channel:
        return imageencoder_pb2_grpc.ImageEncoderServiceStub(channel).GetInfo(
            imageencoder_pb2.GetInfoRequest(model=model), timeout=120)


def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def prompt_tokens(mesh: Mesh, *parts: dict[str, Any]) -> int:
    r = client(mesh).chat.completions.create(model=mesh.extra["model"], max_tokens=2, messages=[
        {"role": "user", "content": [*parts, {"type": "text", "text": "What animal is in the picture?"}]}])
    assert r.choices[0].message.content == "xx"
    return r.usage.prompt_tokens


def test_the_services_rows_are_the_in_process_encoders_and_a_repeat_is_not_encoded_again(emesh: Mesh) -> None:
    from embedmesh.models.convert import resolve_model_path
    from embedmesh.vision.stage import SoftPromptEncoder

    assert info(emesh).encodes == 0
    local = SoftPromptEncoder(Path(resolve_model_path("default")))  # the preprocessor's in-process encoder
    rows = local.encode(np.asarray(Image.open(photo("chelsea.png")).convert("RGB")))
    five_rows = prompt_tokens(emesh, {"type": "prompt_embeds", "data": b64_of(torch.zeros(5, 576))})
    assert prompt_tokens(emesh, image_part("chelsea.png")) - five_rows == rows.shape[0] - 5
    described = info(emesh, emesh.extra["model"])
    # The same identity: the preprocessor keyed the rows exactly as its in-process stage would have.
    assert described.model.identity == local.identity and described.model.hidden_size == 576
    assert described.encodes == 1
    assert prompt_tokens(emesh, image_part("chelsea.png")) - five_rows == rows.shape[0] - 5
    assert info(emesh).encodes == 1  # the repeat came from the preprocessor's cache


def test_with_the_encode_service_killed_a_new_image_is_a_503_naming_the_encoder_and_text_still_works(
        emesh: Mesh) -> None:
    assert prompt_tokens(emesh, image_part("chelsea.png")) > 0  # cached (or encoded now if run alone)
    pid = int(re.search(rb"image-encoder-0\s+\S+\s+\(pid (\d+)\)", Path(emesh.log_path).read_bytes()).group(1))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as e:
        prompt_tokens(emesh, image_part("coffee.png"))
    assert e.value.status_code == 503
    message = str(e.value)
    assert "image encoder efficientnet-lite0" in message and emesh.extra["encoder"] in message, message
    assert "messages[0].content[0].image_url" in message
    r = client(emesh).chat.completions.create(model=emesh.extra["model"], max_tokens=3,
                                               messages=[{"role": "user", "content": "Hello"}])
    assert r.choices[0].message.content == "xxx"
    assert prompt_tokens(emesh, image_part("chelsea.png")) > 0  # an image already encoded needs no encoder
    assert emesh.proc.poll() is None  # the launcher keeps the mesh up without its image encoder

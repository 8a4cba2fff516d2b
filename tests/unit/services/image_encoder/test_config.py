"""The image encode service's settings: flags, variables and range checks."""

from __future__ import annotations

import pytest

from embedmesh.services.image_encoder.config import ImageEncoderConfig


def test_flags_and_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDMESH_IMAGE_ENCODER_MAX_QUEUE", "3")
    c = ImageEncoderConfig.from_args(["--port", "0", "--model-tokenizers", "a=/m/a,b=/m/b",
                                      "--max-image-pixels", "1000"])
    assert (c.port, c.max_queue, c.model_tokenizers) == (0, 3, (("a", "/m/a"), ("b", "/m/b")))
    assert c.encoder == "efficientnet-lite0" and c.max_message_bytes == 3000 + 1024 * 1024


@pytest.mark.parametrize("kw,words", [
    ({"encoder": "clip"}, "encoder must be one of"),
    ({"encoder": "dinov2"}, "needs image_projector"),
    ({"max_image_pixels": 0}, "max_image_pixels"),
    ({"max_image_pixels": 16384 * 16384 + 1}, "max_image_pixels"),
    ({"max_queue": 0}, "max_queue"),
    ({"port": 70000}, "port"),
    ({"tokenizer": ""}, "--tokenizer or --model-tokenizers"),
])
def test_out_of_range_settings_are_refused_by_name(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ImageEncoderConfig(**kw)  # type: ignore[arg-type]

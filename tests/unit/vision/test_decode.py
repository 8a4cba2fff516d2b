"""Bounded image decoding: every refusal names the part and the rule, before the pixels are allocated."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from embedmesh.core.errors import InvalidArgument
from embedmesh.vision.decode import ImageLimits, data_url_bytes, decode_image, sniff_format

FIELD = "messages[0].content[1].image_url"
LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20, max_side=4096)


def encoded(fmt: str, size: tuple[int, int] = (64, 48), seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG header (valid CRCs) claiming ``width x height``, with a few bytes of pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + _chunk(b"IEND", b""))


def refusal(fn, *args) -> InvalidArgument:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument) as e:
        fn(*args)
    assert e.value.field == FIELD
    assert e.value.message.startswith(FIELD + ": ")
    return e.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_accepted_formats_decode_to_rgb_pixels(fmt: str) -> None:
    raw = encoded(fmt)
    img = decode_image(data_url_bytes(data_url(raw, f"image/{fmt.lower()}"), FIELD, LIMITS), FIELD, LIMITS)
    assert img.format == fmt
    assert img.pixels.shape == (48, 64, 3) and img.pixels.dtype == np.uint8
    if fmt != "JPEG":  # lossless: the very pixels
        expected = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
        assert np.array_equal(img.pixels, expected)


def test_digest_follows_pixels_not_file_bytes() -> None:
    a = decode_image(encoded("PNG", seed=1), FIELD, LIMITS)
    im = Image.fromarray(np.asarray(a.pixels))
    buf = io.BytesIO()
    im.save(buf, format="PNG", compress_level=0)  # other bytes, same pixels
    b = decode_image(buf.getvalue(), FIELD, LIMITS)
    c = decode_image(encoded("PNG", seed=2), FIELD, LIMITS)
    assert buf.getvalue() != encoded("PNG", seed=1)
    assert a.digest == b.digest
    assert a.digest != c.digest


def test_truncated_png_is_refused() -> None:
    raw = encoded("PNG", (256, 256))
    e = refusal(decode_image, raw[: len(raw) // 2], FIELD, LIMITS)
    assert e.reason == "BAD_IMAGE" and "truncated" in e.message


def test_png_header_claiming_100000_by_100000_is_refused_before_decoding() -> None:
    e = refusal(decode_image, png_claiming(100_000, 100_000), FIELD, LIMITS)
    assert e.reason == "TOO_MANY_PIXELS" and str(LIMITS.max_pixels) in e.message


def test_pixel_cap_is_ours_not_pillows() -> None:
    # 2048 x 1024 is far below Pillow's own bomb limit (89M pixels) but above this cap (1M).
    e = refusal(decode_image, png_claiming(2048, 1024), FIELD, LIMITS)
    assert e.reason == "TOO_MANY_PIXELS"
    # and a long thin strip is refused by the side cap
    e = refusal(decode_image, png_claiming(8192, 1), FIELD, LIMITS)
    assert e.reason == "TOO_MANY_PIXELS"


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


def test_svg_is_refused_by_media_type() -> None:
    e = refusal(data_url_bytes, data_url(SVG, "image/svg+xml"), FIELD, LIMITS)
    assert e.reason == "FORMAT_NOT_ALLOWED" and "image/svg+xml" in e.message


def test_svg_bytes_labelled_png_are_refused_by_content() -> None:
    data = data_url_bytes(data_url(SVG, "image/png"), FIELD, LIMITS)
    e = refusal(decode_image, data, FIELD, LIMITS)
    assert e.reason == "FORMAT_NOT_ALLOWED" and "SVG" in e.message


def test_gif_is_refused() -> None:
    e = refusal(decode_image, encoded("GIF"), FIELD, LIMITS)
    assert e.reason == "FORMAT_NOT_ALLOWED" and "GIF" in e.message


@pytest.mark.parametrize("body", ["not base64!!", "iVBORw0KGgo", "iVBO RW0K"])
def test_bad_base64_is_refused(body: str) -> None:
    e = refusal(data_url_bytes, f"data:image/png;base64,{body}", FIELD, LIMITS)
    assert e.reason == "BAD_BASE64"


def test_too_many_bytes_refused_before_base64_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    import embedmesh.vision.decode as decode

    def never(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("decoded base64 past the cap")

    monkeypatch.setattr(decode.pybase64, "b64decode", never)
    url = "data:image/png;base64," + "A" * (4 * ((LIMITS.max_bytes + 2) // 3) + 4)
    e = refusal(data_url_bytes, url, FIELD, LIMITS)
    assert e.reason == "TOO_LARGE" and str(LIMITS.max_bytes) in e.message


def test_raw_bytes_over_the_cap_are_refused() -> None:
    e = refusal(decode_image, b"\x89PNG\r\n\x1a\n" + b"\x00" * LIMITS.max_bytes, FIELD, LIMITS)
    assert e.reason == "TOO_LARGE"


@pytest.mark.parametrize("url,reason", [
    ("data:image/png,plain", "BAD_DATA_URL"),
    ("data:image/png;base64", "BAD_DATA_URL"),
    ("file:///etc/passwd", "BAD_DATA_URL"),
    ("data:;base64,AAAA", "FORMAT_NOT_ALLOWED"),
    ("data:image/gif;base64,R0lGODlh", "FORMAT_NOT_ALLOWED"),
])
def test_malformed_data_urls_are_refused(url: str, reason: str) -> None:
    assert refusal(data_url_bytes, url, FIELD, LIMITS).reason == reason


def test_sniff() -> None:
    assert sniff_format(encoded("PNG")) == "PNG"
    assert sniff_format(encoded("JPEG")) == "JPEG"
    assert sniff_format(encoded("WEBP")) == "WEBP"
    assert sniff_format(encoded("GIF")) is None

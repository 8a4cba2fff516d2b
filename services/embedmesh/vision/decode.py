"""Images from untrusted requests, decoded within bounds set before anything is allocated.

    source             a chat part's ``image_url.url`` (a ``data:`` URL, or ``http(s)`` when the host is allowed),
                       or the image file's bytes (gRPC)
      -> bytes         ``data:`` URL: media type allowlisted, base64 length checked against the byte cap *before*
                       decoding, strict base64; ``http(s)``: refused unless the host is configured, then fetched
                       with a byte cap and a time limit (``fetch.py``)
      -> format        sniffed from the magic bytes: PNG, JPEG or WebP only (SVG, GIF, BMP, TIFF... refused)
      -> header        Pillow opens lazily (header only); width x height checked against the pixel cap here, so a
                       decompression bomb (a tiny file claiming 100000 x 100000) is refused before one pixel is
                       allocated; Pillow's own bomb warning is not relied on (its error, past twice its limit, is
                       mapped to the same refusal)
      -> pixels        the first frame decoded; a truncated file is refused (never padded with grey); RGB uint8
      -> digest        BLAKE3-256 over the size and the RGB bytes: the image's identity for the encoder cache and
                       routing (two files with the same pixels, e.g. PNG re-compressed, share it)

Every refusal is an ``InvalidArgument`` naming the part (``messages[0].content[1].image_url``) and the rule.
"""

from __future__ import annotations

import binascii
import io
import re
import warnings
from dataclasses import dataclass

import blake3
import numpy as np
import pybase64

from embedmesh.core.errors import InvalidArgument

__all__ = ["ImageLimits", "DecodedImage", "FORMATS", "data_url_bytes", "decode_image", "sniff_format"]

FORMATS = ("PNG", "JPEG", "WEBP")
"""The image formats accepted (Pillow's names)."""

_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_DATA_URL = re.compile(r"data:([A-Za-z0-9.+/-]*)((?:;[A-Za-z0-9=._+-]+)*),", re.ASCII)
_HEAD = 512
"""The part of a data URL before its comma is looked for in this many characters only."""


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on one image (the preprocessor's config sets them)."""

    max_bytes: int = 20 * 1024 * 1024
    """The image file's size (after base64 decoding), checked before decoding the base64."""
    max_pixels: int = 4096 * 4096
    """width x height, read from the header before the pixels are decoded."""
    max_side: int = 16384
    """The longest side, however few pixels (a 1 x 10^6 strip is refused too)."""


@dataclass(frozen=True)
class DecodedImage:
    """An image's pixels (``(height, width, 3)`` uint8, RGB) and their digest."""

    pixels: np.ndarray
    format: str
    digest: str
    """BLAKE3-256 hex of ``<width>x<height>:`` + the RGB bytes."""


def _refuse(field: str, rule: str, reason: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {rule}", field=field, reason=reason)


def data_url_bytes(url: str, field: str, limits: ImageLimits) -> bytes:
    """A ``data:image/<png|jpeg|webp>;base64,...`` URL -> the file's bytes (byte cap checked before decoding)."""
    m = _DATA_URL.match(url[:_HEAD])
    if m is None:
        raise _refuse(field, "must be a data: URL (data:image/png;base64,...) with a comma before the data",
                      "BAD_DATA_URL")
    media, params = m.group(1).lower(), m.group(2).lower().split(";")[1:]
    if media not in _MEDIA_TYPES:
        raise _refuse(field, f"media type {media or '(none)'!r} is not accepted; send PNG, JPEG or WebP "
                             "(image/png, image/jpeg, image/webp)", "FORMAT_NOT_ALLOWED")
    if "base64" not in params:
        raise _refuse(field, "the data: URL must be base64-encoded (data:image/png;base64,...)", "BAD_DATA_URL")
    body = url[m.end():]
    # Every 4 base64 characters carry 3 bytes: a body longer than the cap's encoding is refused unread.
    if len(body) > 4 * ((limits.max_bytes + 2) // 3):
        raise _refuse(field, f"the image is larger than the cap of {limits.max_bytes} bytes", "TOO_LARGE")
    try:
        data = pybase64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _refuse(field, f"the data is not valid base64 ({e})", "BAD_BASE64") from None
    if len(data) > limits.max_bytes:
        raise _refuse(field, f"the image is larger than the cap of {limits.max_bytes} bytes", "TOO_LARGE")
    return data


def sniff_format(data: bytes | memoryview) -> str | None:
    """PNG, JPEG or WEBP from the first bytes; None for anything else."""
    head = bytes(data[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def _what_else(data: bytes | memoryview) -> str:
    head = bytes(data[:256]).lstrip().lower()
    if head.startswith((b"gif87a", b"gif89a")):
        return "GIF"
    if head.startswith(b"<?xml") or head.startswith(b"<svg") or b"<svg" in head:
        return "SVG"
    if head.startswith(b"bm"):
        return "BMP"
    if head.startswith((b"ii*\x00", b"mm\x00*")):
        return "TIFF"
    return "an unrecognized format"


def decode_image(data: bytes | memoryview, field: str, limits: ImageLimits) -> DecodedImage:
    """The file's bytes -> RGB pixels and their digest, refusing (``InvalidArgument`` naming ``field``) anything
    over a cap, outside the allowlist, or damaged."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise _refuse(field, f"the image is larger than the cap of {limits.max_bytes} bytes", "TOO_LARGE")
    fmt = sniff_format(data)
    if fmt is None:
        raise _refuse(field, f"the image is {_what_else(data)}; only PNG, JPEG and WebP are accepted",
                      "FORMAT_NOT_ALLOWED")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=[fmt])  # header only
    except Image.DecompressionBombError as e:
        raise _refuse(field, f"the image has more than {limits.max_pixels} pixels ({e})", "TOO_MANY_PIXELS") \
            from None
    except Exception as e:  # noqa: BLE001 - any parse failure of untrusted bytes is the client's
        raise _refuse(field, f"the {fmt} file could not be read ({type(e).__name__}: {e})", "BAD_IMAGE") from None
    with im:
        width, height = im.size
        if width < 1 or height < 1 or max(width, height) > limits.max_side or width * height > limits.max_pixels:
            raise _refuse(field, f"the image is {width} x {height} pixels; the cap is {limits.max_pixels} pixels "
                                 f"and {limits.max_side} on a side", "TOO_MANY_PIXELS")
        try:
            if fmt == "JPEG":
                im.draft("RGB", (width, height))
            im.seek(0)
            im.load()  # raises on a truncated file (ImageFile.LOAD_TRUNCATED_IMAGES stays False)
            rgb = im.convert("RGB")
        except Exception as e:  # noqa: BLE001 - any decode failure of untrusted bytes is the client's
            raise _refuse(field, f"the {fmt} file is damaged or truncated ({type(e).__name__}: {e})",
                          "BAD_IMAGE") from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    if pixels.shape != (height, width, 3):
        raise _refuse(field, f"the {fmt} file decoded to an unexpected shape {pixels.shape}", "BAD_IMAGE")
    h = blake3.blake3(f"{width}x{height}:".encode())
    h.update(np.ascontiguousarray(pixels).reshape(-1).data)
    pixels.setflags(write=False)
    return DecodedImage(pixels, fmt, h.hexdigest())

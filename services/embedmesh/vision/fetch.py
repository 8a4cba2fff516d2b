"""``http(s)`` image URLs: refused unless their host is configured, then fetched with a byte cap and a deadline.

The preprocessor fetching any URL a client names would let clients make it call internal addresses (SSRF), so
nothing is fetched by default. With ``--image-url-hosts`` set, only those exact host names are fetched; redirects
are not followed (a redirect could leave the allowlist); the body is read in pieces, refused past the byte cap
(before more is read) or past the deadline. Runs in a thread (blocking ``urllib``).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from embedmesh.core.errors import InvalidArgument

__all__ = ["fetch_image", "is_http_url"]

_PIECE = 64 * 1024


def is_http_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _refuse(field: str, rule: str, reason: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {rule}", field=field, reason=reason)


def fetch_image(url: str, field: str, *, hosts: Sequence[str], max_bytes: int, timeout_seconds: float) -> bytes:
    """The image file's bytes at ``url`` (an allowed host's), or an ``InvalidArgument`` naming ``field``."""
    if not hosts:
        raise _refuse(field, "http(s) image URLs are not fetched by this server (no image hosts are configured); "
                             "send the image inline as a data: URL (data:image/png;base64,...)", "URL_NOT_ALLOWED")
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        raise _refuse(field, "is not a valid URL", "BAD_URL") from None
    if host not in {h.lower() for h in hosts}:
        raise _refuse(field, f"host {host!r} is not among the image hosts this server fetches from; send the image "
                             "inline as a data: URL", "URL_NOT_ALLOWED")
    deadline = time.monotonic() + timeout_seconds
    opener = urllib.request.build_opener(_NoRedirect)
    request = urllib.request.Request(url, headers={"User-Agent": "embedmesh-image-fetch", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout_seconds) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise _refuse(field, f"the image is larger than the cap of {max_bytes} bytes", "TOO_LARGE")
            chunks: list[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:
                    raise _refuse(field, f"fetching the image took longer than {timeout_seconds:g} s",
                                  "FETCH_TIMEOUT")
                piece = response.read(_PIECE)
                if not piece:
                    break
                size += len(piece)
                if size > max_bytes:
                    raise _refuse(field, f"the image is larger than the cap of {max_bytes} bytes", "TOO_LARGE")
                chunks.append(piece)
    except urllib.error.HTTPError as e:
        raise _refuse(field, f"fetching the image failed: HTTP {e.code}", "FETCH_FAILED") from None
    except TimeoutError:
        raise _refuse(field, f"fetching the image took longer than {timeout_seconds:g} s", "FETCH_TIMEOUT") from None
    except (urllib.error.URLError, OSError) as e:
        raise _refuse(field, f"fetching the image failed ({type(e).__name__})", "FETCH_FAILED") from None
    return b"".join(chunks)

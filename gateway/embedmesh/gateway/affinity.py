"""Image affinity: the key that sends a repeated image to the preprocessor replica that already holds its rows.

Each preprocessor replica keeps the images it encoded in its own L1 (docs/images.md); a repeat that lands on
another replica costs a Redis L2 lookup, or a whole encode without Redis. So for a request carrying images the
gateway computes a key from the first image part as the client sent it (a chat ``image_url`` URL, a Responses
``input_image``: both reach ``translate.chat_params`` as the same part) and sends it as gRPC metadata
``x-embedmesh-affinity`` on its calls for that request; the gateway's Envoy egress to the preprocessor hashes that
header to pick the replica (consistent hashing, deploy/envoy/generate.py), so the same image goes to the same
replica while the set of replicas stays the same. A request without images carries no header and is spread as any
other.

The key is a hint for the load balancer, never an identity: the preprocessor computes its own cache key from the
decoded pixels. It is BLAKE3 over the URL's length and its first ``PREFIX_CHARS`` characters (a ``data:`` URL's
first 192 KiB of image file), 16 hex digits: the cost per request is bounded whatever the image's size, and two
different images share a key only if they agree on that much of their bytes and on their length (they then share
a replica, nothing more). Computing it never fails a request: a URL that cannot be hashed gets no key.

The key lives in a ContextVar of the request's task (``remember``), read by the channel's metadata provider
(``metadata``, an ``embedmesh.core.call_metadata.Added`` in ``auth.forwarding_channel``) when each call is made.
"""

from __future__ import annotations

import contextvars

import blake3

__all__ = ["HEADER", "PREFIX_CHARS", "key_of", "remember", "current", "metadata"]

HEADER = "x-embedmesh-affinity"
"""The gRPC metadata key (and HTTP/2 header Envoy hashes)."""

PREFIX_CHARS = 256 * 1024
"""How much of an image URL the key covers (besides its length): bounds the hashing per request."""

_DIGEST_BYTES = 8

_key: contextvars.ContextVar[str] = contextvars.ContextVar("embedmesh_affinity", default="")


def key_of(url: str) -> str:
    """The affinity key of one image part's URL: 16 hex digits ("" when the URL cannot be hashed)."""
    try:
        h = blake3.blake3(len(url).to_bytes(8, "little"))
        h.update(url[:PREFIX_CHARS].encode("utf-8", "surrogatepass"))
        return h.hexdigest(length=_DIGEST_BYTES)
    except Exception:  # noqa: BLE001 - a hint: whatever goes wrong, the request goes on without one
        return ""


def remember(first_image: str | None) -> None:
    """Set the current request's key from its first image part's URL (None: the request carries no image, so its
    calls carry no header). Called once per translated chat request, in the request's own task."""
    _key.set(key_of(first_image) if first_image else "")


def current() -> str:
    """The current request's key ("" outside a request or for one without images)."""
    return _key.get()


def metadata() -> list[tuple[str, str]]:
    """The header for the calls made for the current request: none when it carries no image."""
    key = _key.get()
    return [(HEADER, key)] if key else []

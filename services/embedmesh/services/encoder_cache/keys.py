"""Cache keys and the two key spaces of the encoder cache.

- **Validated entries** (``v1:…``): rows the server itself decoded and checked (``v1:payload:…``: a serialized
  prompt_embeds payload validated for one model shape; ``v1:embed:…``: an embedding vector a worker computed). Their
  keys are computed by the server only, from the content (BLAKE3, 256 bits) and what validation depended on. No RPC
  can write, read or delete a ``v1:`` key: every client-facing name is a plain name that lands in a tenant namespace.
- **Client uploads** (``u:<tenant>:<name>``): what a caller stored through ``EncoderCacheService.Put``. The name is
  either a random id handed out by the server (``emb-`` + 128 random bits) or a plain name the caller chose
  (``[A-Za-z0-9._-]{1,128}``); either way it is resolved only inside the caller's tenant, so another tenant's id is
  exactly as unknown as one that never existed.
"""

from __future__ import annotations

import re
import secrets
import struct
from collections.abc import Sequence

import blake3

__all__ = ["content_key", "payload_key", "validated_key", "new_upload_id", "is_plain_name", "tenant_key",
           "UPLOAD_PREFIX", "VALIDATED_PREFIX", "TENANT_PREFIX", "NAME_RULE"]

UPLOAD_PREFIX = "emb-"
"""Ids the server hands out: ``emb-`` + 32 hex digits of ``secrets.token_hex(16)``."""
VALIDATED_PREFIX = "v1:"
"""Key space of entries the server validated; never reachable from a client-chosen name."""
TENANT_PREFIX = "u:"
"""Key space of client uploads: ``u:<tenant>:<name>``."""
NAME_RULE = "[A-Za-z0-9._-]{1,128}"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def content_key(dtype: int, shape: Sequence[int], data: bytes | memoryview) -> str:
    """Hash of a tensor by value over (dtype, shape, bytes); internal (never handed to a client as an id)."""
    h = blake3.blake3(struct.pack(f"<I{len(shape)}q", dtype, *shape), max_threads=blake3.blake3.AUTO)
    h.update(data)
    return h.hexdigest()


def validated_key(namespace: str, digest: str) -> str:
    """``v1:<namespace>:<digest>``: the key of an entry the server validated."""
    return f"{VALIDATED_PREFIX}{namespace}:{digest}"


def payload_key(namespace: str, raw: bytes | memoryview) -> str:
    """Key of a serialized payload validated for ``namespace`` (e.g. ``payload:<dtype>:<hidden>``): a repeat skips
    decoding. 256-bit BLAKE3 of the bytes, in the validated key space."""
    return validated_key(namespace, blake3.blake3(raw, max_threads=blake3.blake3.AUTO).hexdigest())


def new_upload_id() -> str:
    """A fresh, unguessable upload id (128 random bits)."""
    return UPLOAD_PREFIX + secrets.token_hex(16)


def is_plain_name(name: str) -> bool:
    """Whether ``name`` is a client-facing name (``[A-Za-z0-9._-]{1,128}``: no ``:``, so no key space prefix)."""
    return bool(_NAME.fullmatch(name))


def tenant_key(tenant: str, name: str) -> str:
    """Where a tenant's upload ``name`` is stored. ``name`` must be a plain name (ValueError otherwise)."""
    if not is_plain_name(name):
        raise ValueError(f"not a plain name: {name!r}")
    return f"{TENANT_PREFIX}{tenant}:{name}"

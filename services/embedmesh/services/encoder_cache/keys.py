"""Cache keys. BLAKE3 (cryptographic, ~6 GB/s here) so a client cannot craft a collision that would make another
client's request use its tensor, and equal tensors share one entry whatever form they arrived in."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import blake3

__all__ = ["content_key", "payload_key", "UPLOAD_PREFIX"]

UPLOAD_PREFIX = "emb-"


def content_key(dtype: int, shape: Sequence[int], data: bytes | memoryview) -> str:
    """Key of a tensor by value: hash over (dtype, shape, bytes)."""
    h = blake3.blake3(struct.pack(f"<I{len(shape)}q", dtype, *shape), max_threads=blake3.blake3.AUTO)
    h.update(data)
    return UPLOAD_PREFIX + h.hexdigest(16)


def payload_key(namespace: str, raw: bytes | memoryview) -> str:
    """Key of a serialized payload (e.g. the bytes of a torch.save file): skip decoding on a repeat."""
    return f"{namespace}:" + blake3.blake3(raw, max_threads=blake3.blake3.AUTO).hexdigest(16)

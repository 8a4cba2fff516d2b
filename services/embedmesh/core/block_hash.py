"""Chained block hashes of a prompt, the same on the request side (preprocessor) and the event side (workers).

Positions are grouped into blocks of ``block_size``; only full blocks hash (a partial tail block is never shared
by a KV cache either). A block's hash is ``BLAKE3(parent_hash || content)`` truncated to 63 bits, never 0 (0 is
``ROOT``, the parent of a prompt's first block), so it fits a proto ``uint64`` and a Python int key, and equal
hashes mean equal *prefixes*, not just equal blocks: that is what lets the router's radix tree be keyed by hash.

A block's content is a sequence of tagged runs, one per kind of position it covers:

    b"T" + u32 count + count x i32 token ids                                        (text)
    b"E" + u32 count + u32 hidden size + numpy dtype string + the rows' raw bytes   (prompt embeddings)

The tags keep a token block from ever colliding with an embeddings block whose bytes happen to spell the same ids,
and a block that straddles text and embeddings chains both runs in order. Embedding rows are hashed in the model
dtype (the preprocessor casts before hashing, the worker hashes what it received), so the two sides agree. BLAKE3 is
keyed by nothing process-local (unlike Python's ``hash()``), so every process computes the same values.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import blake3
import numpy as np

__all__ = ["ROOT", "block_hashes", "hash_token_blocks", "adapter_block_hashes"]

ROOT = 0
"""Parent of a prompt's first block; never the hash of a block."""

_MASK = (1 << 63) - 1
_TOKEN_DTYPE = np.dtype("<i4")

Piece = Sequence[int] | np.ndarray
"""Token ids (a tuple or list) or embedding rows (a 2-D array already in the model dtype)."""


def _finish(h: Any) -> int:
    return (int.from_bytes(h.digest(8), "little") & _MASK) or 1


def _check(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def _as_piece(piece: Any) -> tuple[int, ...] | np.ndarray:
    """Accept the worker's domain segments (``TokenSegment.ids`` / ``EmbedsSegment.rows``) as well as raw pieces."""
    if isinstance(piece, np.ndarray):
        if piece.ndim != 2:
            raise ValueError(f"embedding rows must be 2-D (rows, hidden), got shape {piece.shape}")
        return piece
    rows = getattr(piece, "rows", None)
    if isinstance(rows, np.ndarray):
        return _as_piece(rows)
    ids = getattr(piece, "ids", piece)
    return tuple(ids)


def _merged(pieces: Iterable[Any]) -> list[tuple[int, ...] | np.ndarray]:
    """Adjacent pieces of one kind joined, so where a prompt was split into pieces never changes its hashes."""
    out: list[tuple[int, ...] | np.ndarray] = []
    for raw in pieces:
        piece = _as_piece(raw)
        if not len(piece):
            continue
        is_rows = isinstance(piece, np.ndarray)
        if out and isinstance(out[-1], np.ndarray) == is_rows:
            prev = out[-1]
            if is_rows:
                out[-1] = np.concatenate([prev, piece])  # type: ignore[list-item]
            else:
                out[-1] = (*prev, *piece)  # type: ignore[misc]
        else:
            out.append(piece)
    return out


_MEMO: dict[int, tuple[weakref.ref[np.ndarray], dict[int, list[int]]]] = {}
"""Hashes of read-only row arrays by block size, for as long as the array lives (keyed by ``id``, dropped when the
array dies): the encoder cache hands out the same read-only array for every hit of a payload
(``prompt_embeds.EmbedsResolver``), so a repeated prompt is hashed once. An array that can still be written to is
never memoized (its contents could change)."""


def _forget(ref: weakref.ref[np.ndarray], key: int) -> None:
    entry = _MEMO.get(key)
    if entry is not None and entry[0] is ref:
        del _MEMO[key]


def block_hashes(pieces: Iterable[Any], block_size: int) -> list[int]:
    """Hashes of every full block of a prompt given in order as pieces: token-id sequences, 2-D row arrays
    (model dtype), or the worker's ``TokenSegment`` / ``EmbedsSegment``."""
    _check(block_size)
    merged = _merged(pieces)
    if len(merged) == 1 and not isinstance(merged[0], np.ndarray):
        return hash_token_blocks(merged[0], block_size)
    rows = merged[0] if len(merged) == 1 else None
    if isinstance(rows, np.ndarray) and not rows.flags.writeable:
        key = id(rows)
        entry = _MEMO.get(key)
        if entry is None or entry[0]() is not rows:
            entry = (weakref.ref(rows, lambda r: _forget(r, key)), {})
            _MEMO[key] = entry
        memo = entry[1]
        if block_size not in memo:
            memo[block_size] = _block_hashes(merged, block_size)
        return list(memo[block_size])
    return _block_hashes(merged, block_size)


def _block_hashes(merged: list[tuple[int, ...] | np.ndarray], block_size: int) -> list[int]:
    out: list[int] = []
    parent = ROOT
    h = blake3.blake3(struct.pack("<Q", parent))
    filled = 0
    for piece in merged:
        if isinstance(piece, np.ndarray):
            rows = np.ascontiguousarray(piece)
            header = struct.pack("<I", rows.shape[1]) + rows.dtype.str.encode()
            data = memoryview(rows.reshape(-1).view(np.uint8))
            row_bytes = rows.shape[1] * rows.dtype.itemsize
            n = rows.shape[0]
        else:
            data = memoryview(np.asarray(piece, dtype=_TOKEN_DTYPE).view(np.uint8))
            n = len(piece)
            row_bytes = 4
        start = 0
        if isinstance(piece, np.ndarray):
            # Whole blocks inside this piece: parent, tag and rows hashed in one call (the same bytes as the
            # incremental path below, so the same hash; one 36 KB copy is cheaper than a second update).
            tag = b"E" + struct.pack("<I", block_size) + header
            pack = struct.Struct("<Q").pack
            step = block_size * row_bytes
            if filled == 0:
                while n - start >= block_size:
                    b0 = start * row_bytes
                    parent = _finish(blake3.blake3(pack(parent) + tag + data[b0:b0 + step]))
                    out.append(parent)
                    start += block_size
                h = blake3.blake3(pack(parent))
        while start < n:
            take = min(block_size - filled, n - start)
            chunk = data[start * row_bytes:(start + take) * row_bytes]
            if isinstance(piece, np.ndarray):
                h.update(b"E" + struct.pack("<I", take) + header)
            else:
                h.update(b"T" + struct.pack("<I", take))
            h.update(chunk)
            filled += take
            start += take
            if filled == block_size:
                parent = _finish(h)
                out.append(parent)
                h = blake3.blake3(struct.pack("<Q", parent))
                filled = 0
    return out


def hash_token_blocks(ids: Sequence[int], block_size: int) -> list[int]:
    """Fast path for a text-only prompt; equal to ``block_hashes([ids], block_size)``.

    The ids are packed to little-endian int32 once and each block hashes one contiguous slice.
    """
    _check(block_size)
    n = len(ids) // block_size
    if not n:
        return []
    data = np.asarray(ids[: n * block_size], dtype=_TOKEN_DTYPE).tobytes()
    tag = b"T" + struct.pack("<I", block_size)
    step = 4 * block_size
    pack = struct.Struct("<Q").pack
    out: list[int] = []
    parent = ROOT
    for i in range(n):
        digest = blake3.blake3(pack(parent) + tag + data[i * step:(i + 1) * step]).digest(8)
        parent = (int.from_bytes(digest, "little") & _MASK) or 1
        out.append(parent)
    return out


def adapter_block_hashes(hashes: list[int], adapter: str) -> list[int]:
    """The block hashes of a prompt run under a LoRA adapter: each base hash re-keyed by the adapter's name, so a
    prefix computed under one adapter (or the base model) is never credited to another. Deterministic across
    processes (BLAKE3), never 0, and equal prefixes under the same adapter still give equal chains."""
    if not adapter:
        return hashes
    key = blake3.blake3(b"embedmesh-lora\x00" + adapter.encode()).digest()
    return [_finish(blake3.blake3(struct.pack("<Q", h), key=key)) for h in hashes]

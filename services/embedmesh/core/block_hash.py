"""Chained block hashes of a prompt, the same on the request side (preprocessor) and the event side (workers).

Positions are grouped into blocks of ``block_size``; only full blocks hash. A block's hash is
``BLAKE3(parent_hash || content)`` truncated to 63 bits (non-zero, fits a proto uint64 and a Python int key),
so equal hashes mean equal *prefixes*, not just equal blocks. Content is a sequence of tagged runs: token ids
(tag ``T``) or embedding rows (tag ``E`` + row count + the rows' bytes in the model dtype). Tags keep a token block
from ever colliding with an embeddings block, and a mixed block chains both kinds in order.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import blake3
import numpy as np

__all__ = ["block_hashes", "token_block_hashes", "ROOT"]

ROOT = 0
"""Parent of a prompt's first block."""

_MASK = (1 << 63) - 1


def _finish(h: blake3.blake3) -> int:
    return (int.from_bytes(h.digest(8), "little") & _MASK) or 1


def block_hashes(pieces: Sequence[tuple[int, ...] | Sequence[int] | np.ndarray], block_size: int) -> list[int]:
    """Hashes of every full block of a prompt given as pieces (token-id sequences and row arrays) in order."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    out: list[int] = []
    pieces = _merged(pieces)
    parent = ROOT
    h = blake3.blake3(struct.pack("<Q", parent))
    filled = 0
    for piece in pieces:
        is_rows = isinstance(piece, np.ndarray)
        n = int(piece.shape[0]) if is_rows else len(piece)
        start = 0
        while start < n:
            take = min(block_size - filled, n - start)
            if is_rows:
                rows = np.ascontiguousarray(piece[start:start + take])
                h.update(b"E" + struct.pack("<I", take))
                h.update(memoryview(rows).cast("B"))
            else:
                h.update(b"T" + struct.pack(f"<I{take}i", take, *piece[start:start + take]))
            filled += take
            start += take
            if filled == block_size:
                parent = _finish(h)
                out.append(parent)
                h = blake3.blake3(struct.pack("<Q", parent))
                filled = 0
    return out


def _merged(pieces: Sequence[tuple[int, ...] | Sequence[int] | np.ndarray]) -> list[tuple[int, ...] | np.ndarray]:
    """Adjacent pieces of one kind joined, so where a prompt was split into pieces never changes its hashes."""
    out: list[tuple[int, ...] | np.ndarray] = []
    for piece in pieces:
        is_rows = isinstance(piece, np.ndarray)
        if out and isinstance(out[-1], np.ndarray) == is_rows:
            prev = out[-1]
            out[-1] = np.concatenate([prev, piece]) if is_rows else (*prev, *piece)  # type: ignore[misc]
        else:
            out.append(piece if is_rows else tuple(piece))  # type: ignore[arg-type]
    return out


def token_block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """Fast path for a prompt of token ids only (equal to ``block_hashes([ids], block_size)``)."""
    return block_hashes([tuple(ids)], block_size)

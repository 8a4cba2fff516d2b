"""Chained block hashes: deterministic across processes, prefix-sensitive, and token blocks never collide with
embeddings blocks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from embedmesh.core.block_hash import block_hashes, token_block_hashes


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8), dtype=np.float32)


def test_only_full_blocks_hash() -> None:
    assert len(token_block_hashes(list(range(15)), 4)) == 3
    assert len(block_hashes([rows(7)], 4)) == 1
    assert token_block_hashes([1, 2, 3], 4) == []


def test_same_content_same_hashes_in_another_process() -> None:
    ids = list(range(40))
    here = token_block_hashes(ids, 8)
    code = "from embedmesh.core.block_hash import token_block_hashes; print(token_block_hashes(list(range(40)), 8))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert str(here) == there.strip()


def test_a_change_alters_its_block_and_every_later_one() -> None:
    a = list(range(32))
    b = list(a)
    b[9] = 999
    ha, hb = token_block_hashes(a, 8), token_block_hashes(b, 8)
    assert ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))
    ra, rb = rows(16), rows(16)
    rb[5, 3] += 1e-3
    ea, eb = block_hashes([ra], 4), block_hashes([rb], 4)
    assert ea[0] == eb[0] and all(x != y for x, y in zip(ea[1:], eb[1:], strict=True))


def test_tokens_and_embeddings_never_collide() -> None:
    ids = tuple(range(8))
    as_bytes = np.frombuffer(np.asarray(ids, dtype="<i4").tobytes(), dtype=np.float32).reshape(1, 8)
    token = set(block_hashes([ids], 8))
    embeds = set(block_hashes([np.repeat(as_bytes, 8, axis=0)], 8))
    other = set(block_hashes([rows(8, seed=1)], 8))
    assert not token & embeds and not embeds & other and not token & other


def test_mixed_prompts_chain_both_and_split_points_do_not_matter() -> None:
    ids, r = (1, 2, 3, 4, 5, 6), rows(6)
    mixed = block_hashes([ids, r], 4)
    assert len(mixed) == 3
    # The same positions split into different pieces hash the same way.
    assert block_hashes([ids[:2], ids[2:], r[:1], r[1:]], 4) == mixed
    assert block_hashes([r, ids], 4) != mixed

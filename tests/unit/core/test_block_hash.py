"""Chained block hashes: deterministic across processes, prefix-sensitive, token blocks never collide with
embeddings blocks, mixed prompts chain both, and the token fast path equals the general path."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.core.block_hash import (
    ROOT,
    block_hashes,
    hash_token_blocks,
)
from embedmesh.services.worker.engines.base import EmbedsSegment, TokenSegment


def rows(n: int, seed: int = 0, hidden: int = 8, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, hidden)).astype(dtype)


ids_st = st.lists(st.integers(0, 2**31 - 1), max_size=80)


def test_only_full_blocks_hash() -> None:
    assert len(hash_token_blocks(list(range(15)), 4)) == 3
    assert len(block_hashes([rows(7)], 4)) == 1
    assert hash_token_blocks([1, 2, 3], 4) == [] and block_hashes([], 4) == []


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_token_blocks([1, 2], 0)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([rows(2)], 0)


def test_rows_must_be_2d() -> None:
    with pytest.raises(ValueError, match="2-D"):
        block_hashes([np.zeros(8, np.float32)], 4)


def test_same_content_same_hashes_in_another_process() -> None:
    r = rows(16, seed=3)
    here = [hash_token_blocks(list(range(40)), 8), block_hashes([(1, 2, 3), r], 4)]
    code = ("import numpy as np; from embedmesh.core.block_hash import block_hashes, hash_token_blocks; "
            "r = np.random.default_rng(3).standard_normal((16, 8)).astype('float32'); "
            "print([hash_token_blocks(list(range(40)), 8), block_hashes([(1, 2, 3), r], 4)])")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert str(here) == there.strip()


@settings(max_examples=200, deadline=None)
@given(ids_st, st.integers(1, 9))
def test_fast_path_equals_general_path_and_64_bit_non_root(ids: list[int], bs: int) -> None:
    fast = hash_token_blocks(ids, bs)
    assert fast == block_hashes([tuple(ids)], bs)
    assert fast == block_hashes([ids[:3], tuple(ids[3:])], bs), "split points never matter"
    assert len(fast) == len(ids) // bs
    assert all(0 < h < 2**63 for h in fast) and ROOT not in fast


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=8, max_size=48), st.integers(1, 8), st.data())
def test_a_changed_token_alters_its_block_and_every_later_one(ids: list[int], bs: int, data: st.DataObject) -> None:
    full = len(ids) // bs * bs
    if not full:
        return
    i = data.draw(st.integers(0, full - 1))
    changed = list(ids)
    changed[i] += 1
    a, b = hash_token_blocks(ids, bs), hash_token_blocks(changed, bs)
    k = i // bs
    assert a[:k] == b[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:], strict=True))


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 24), st.integers(1, 6), st.data())
def test_a_changed_row_alters_its_block_and_every_later_one(n: int, bs: int, data: st.DataObject) -> None:
    r = rows(n, seed=n)
    full = n // bs * bs
    if not full:
        return
    i = data.draw(st.integers(0, full - 1))
    col = data.draw(st.integers(0, 7))
    changed = r.copy()
    changed[i, col] = np.nextafter(changed[i, col], np.float32(np.inf))  # the smallest possible change
    a, b = block_hashes([r], bs), block_hashes([changed], bs)
    k = i // bs
    assert a[:k] == b[:k] and all(x != y for x, y in zip(a[k:], b[k:], strict=True))


def test_tokens_and_embeddings_never_collide_even_with_equal_bytes() -> None:
    ids = tuple(range(8))
    # Rows whose raw bytes are exactly the little-endian int32 ids of the token block.
    as_rows = np.frombuffer(np.asarray(ids, dtype="<i4").tobytes(), dtype=np.float32).reshape(8, 1)
    token = set(block_hashes([ids], 8))
    embeds = set(block_hashes([as_rows], 8))
    other = set(block_hashes([rows(8, seed=1)], 8))
    assert not token & embeds and not embeds & other and not token & other


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=4, max_size=40), st.integers(0, 2**32 - 1), st.integers(1, 8))
def test_random_token_and_embedding_prompts_never_share_a_hash(ids: list[int], seed: int, bs: int) -> None:
    token = set(hash_token_blocks(ids, bs))
    embeds = set(block_hashes([rows(len(ids), seed=seed % 1000)], bs))
    assert not token & embeds


def test_same_bytes_in_another_dtype_differ() -> None:
    r = rows(8)
    assert not set(block_hashes([r], 4)) & set(block_hashes([r.view(np.int32)], 4))


def test_mixed_prompts_chain_both_and_split_points_do_not_matter() -> None:
    ids, r = (1, 2, 3, 4, 5, 6), rows(6)
    mixed = block_hashes([ids, r], 4)
    assert len(mixed) == 3
    assert mixed[0] == hash_token_blocks(ids, 4)[0], "a pure-text first block equals the text-only prompt's"
    assert block_hashes([ids[:2], ids[2:], r[:1], r[1:]], 4) == mixed
    assert block_hashes([r, ids], 4) != mixed
    # The straddling block chains both kinds: changing either side of it changes it and what follows.
    assert block_hashes([(1, 2, 3, 4, 5, 7), r], 4)[1:] != mixed[1:]
    r2 = r.copy()
    r2[0, 0] += 1
    other = block_hashes([ids, r2], 4)
    assert other[0] == mixed[0] and other[1] != mixed[1] and other[2] != mixed[2]


def test_segments_hash_like_pieces() -> None:
    r = rows(9)
    segs = [TokenSegment((7, 8, 9)), EmbedsSegment(r), TokenSegment((1, 2, 3, 4))]
    assert block_hashes(segs, 4) == block_hashes([(7, 8, 9), r, (1, 2, 3, 4)], 4)
    assert block_hashes([TokenSegment(()), EmbedsSegment(r)], 4) == block_hashes([r], 4)


def test_bf16_bits_hash_as_stored() -> None:
    bits = rows(8).view(np.uint32).astype(np.uint16)  # any uint16 storage, as bf16 rows travel
    assert len(block_hashes([bits], 4)) == 2
    assert block_hashes([bits], 4) == block_hashes([bits.copy()], 4)


def test_adapter_hashes_are_a_separate_chain_per_adapter() -> None:
    from embedmesh.core.block_hash import adapter_block_hashes

    base = block_hashes([tuple(range(64))], 16)
    a = adapter_block_hashes(base, "lora-a")
    b = adapter_block_hashes(base, "lora-b")
    assert adapter_block_hashes(base, "") == base
    assert len(a) == len(base) == 4 and 0 not in a
    assert not set(a) & set(base) and not set(a) & set(b)  # never credited across adapters or the base model
    assert a == adapter_block_hashes(block_hashes([tuple(range(64))], 16), "lora-a")  # deterministic
    # A shared prefix under one adapter is still a shared prefix.
    longer = adapter_block_hashes(block_hashes([tuple(range(80))], 16), "lora-a")
    assert longer[:4] == a


def test_rows_hash_to_the_values_routers_and_workers_already_hold() -> None:
    """Pinned values (from the incremental implementation, before whole blocks were hashed in one call): a change
    of the hash function would split the router's key space between old and new workers and preprocessors."""
    rows = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    assert block_hashes([rows], 16) == [6069097254257782435, 1352328450927016269]  # whole blocks
    assert block_hashes([(1, 2, 3), rows], 16) == [7716961351518373698, 8297259761770954064]  # straddling


def test_read_only_rows_are_hashed_once_per_block_size_while_they_live(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from embedmesh.core import block_hash

    calls: list[int] = []
    real = block_hash._block_hashes

    def counting(merged: Any, block_size: int) -> list[int]:
        calls.append(block_size)
        return real(merged, block_size)

    monkeypatch.setattr(block_hash, "_block_hashes", counting)
    frozen = rows(40, seed=3)
    frozen.setflags(write=False)
    first = block_hashes([frozen], 8)
    assert block_hashes([frozen], 8) == first and calls == [8]  # the encoder cache's shared rows: hashed once
    assert block_hashes([frozen], 4) != first and calls == [8, 4]
    live = rows(40, seed=3)  # writeable: its contents may change, so it is hashed every time
    assert block_hashes([live], 8) == first
    live[0, 0] += 1
    assert block_hashes([live], 8) != first and calls == [8, 4, 8, 8]
    before = len(block_hash._MEMO)
    del frozen
    gc.collect()
    assert len(block_hash._MEMO) == before - 1  # nothing kept past the array

"""The prefix cache's tensor work (``kv_blocks.py``) on a synthetic cache (no model): blocks cut out of a batch
row hold exactly that row's positions (padding and gaps skipped) as copies, and a past built from blocks holds them
right-aligned with a mask of the same shape, in the layout ``cut_blocks`` reads back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from embedmesh.services.worker.engines.hf.kv_blocks import block_nbytes, build_past, cut_blocks  # noqa: E402

LAYERS, HEADS, DIM = 2, 3, 5


def _batch(mask: list[list[int]]) -> tuple[object, object]:
    """A cache whose key at (layer, row, head, column) encodes them (values: the negation), and its mask."""
    m = torch.tensor(mask)
    rows, cols = m.shape
    cache = DynamicCache()
    for layer in range(LAYERS):
        k = torch.zeros(rows, HEADS, cols, DIM)
        for r in range(rows):
            for c in range(cols):
                k[r, :, c, :] = 1000 * layer + 100 * r + c
        cache.update(k, -k, layer)
    return cache, m


def test_cut_blocks_reads_a_rows_positions_skipping_padding_and_gaps() -> None:
    cache, mask = _batch([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1],
                          [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    blocks = cut_blocks(torch, cache, mask, 0, 0, 3, 2)
    assert len(blocks) == 3 and blocks[0].shape == (LAYERS, 2, HEADS, 2, DIM)
    cols = [2, 3, 4, 5, 7, 8]  # row 0's positions 0..5
    for b, block in enumerate(blocks):
        for layer in range(LAYERS):
            want = [1000 * layer + c for c in cols[2 * b:2 * b + 2]]
            assert block[layer, 0, 0, :, 0].tolist() == want
            assert block[layer, 1, 1, :, 4].tolist() == [-w for w in want]
    assert cut_blocks(torch, cache, mask, 1, 2, 4, 2)[1][0, 0, 0, :, 0].tolist() == [106, 107]
    blocks[0].zero_()  # a copy: the batch is untouched
    assert cache.layers[0].keys[0, 0, 2, 0] == 2
    assert block_nbytes(blocks[0]) == LAYERS * 2 * HEADS * 2 * DIM * 4
    assert cut_blocks(torch, cache, mask, 0, 2, 2, 2) == []
    with pytest.raises(ValueError, match="fewer than block"):
        cut_blocks(torch, cache, mask, 0, 0, 4, 2)


def test_build_past_right_aligns_each_rows_blocks() -> None:
    cache, mask = _batch([[1, 1, 1, 1, 1, 1]])
    blocks = cut_blocks(torch, cache, mask, 0, 0, 3, 2)
    past, past_mask, lengths = build_past(torch, [blocks, [], blocks[:1]], torch.device("cpu"))
    assert lengths == [6, 0, 2]
    assert past_mask.tolist() == [[1] * 6, [0] * 6, [0, 0, 0, 0, 1, 1]]
    for layer in range(LAYERS):
        keys = past.layers[layer].keys
        assert keys.shape == (3, HEADS, 6, DIM)
        assert keys[0, 0, :, 0].tolist() == [1000 * layer + c for c in range(6)]
        assert keys[2, 0, 4:, 0].tolist() == [1000 * layer, 1000 * layer + 1]
        assert not keys[1].any()
    # Read back through the mask: the same blocks.
    again = cut_blocks(torch, past, past_mask, 2, 0, 1, 2)
    assert torch.equal(again[0], blocks[0])

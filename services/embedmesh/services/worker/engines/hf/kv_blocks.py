"""The prefix cache's tensor work (``prefix_cache.py`` keeps the bookkeeping) and its use by the engine
(``PrefixReuse``): cutting a sequence's full blocks out of
a batch's KV cache, and laying cached blocks out as the past of a prefill.

A block is one tensor ``(layers, 2, kv_heads, block_size, head_dim)`` (keys then values), a copy that shares no
storage with the batch it came from. A row's positions are the columns where its mask is 1, in order (padding on the
left, and between a cached past and its suffix when rows of one prefill have different lengths: the attention mask
hides those columns and position ids are given, so a gap changes nothing the row computes).
"""

from __future__ import annotations

from typing import Any

from embedmesh.services.worker.engines.hf.prefix_cache import PrefixCache, request_hashes
from embedmesh.services.worker.engines.hf.sequence import Seq

__all__ = ["PrefixReuse", "cut_blocks", "build_past", "block_nbytes"]


def block_nbytes(block: Any) -> int:
    return int(block.numel() * block.element_size())


def cut_blocks(torch: Any, cache: Any, mask: Any, row: int, first: int, last: int, block_size: int) -> list[Any]:
    """Blocks ``first`` to ``last - 1`` of row ``row`` (its positions ``first * block_size`` on), as copies."""
    if last <= first:
        return []
    cols = mask[row].nonzero().squeeze(1)[first * block_size:last * block_size]
    if cols.numel() != (last - first) * block_size:
        raise ValueError(f"row {row} holds {int(mask[row].sum())} positions, fewer than block {last - 1} needs")
    parts = [torch.stack([layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols)])
             for layer in cache.layers]
    whole = torch.stack(parts)  # (layers, 2, heads, n * block_size, head_dim)
    return [b.clone() for b in whole.split(block_size, dim=3)]


def build_past(torch: Any, pasts: list[list[Any]], device: Any) -> tuple[Any, Any, list[int]]:
    """A DynamicCache holding each row's cached blocks right-aligned at the same width (zeros on the left), its
    mask, and each row's past length in positions. Every row of ``pasts`` is a list of blocks (empty: no past)."""
    from transformers import DynamicCache

    sample = next(b for row in pasts for b in row)
    layers, _, heads, block, dim = sample.shape
    lengths = [len(row) * block for row in pasts]
    width = max(lengths)
    rows = []
    for row, n in zip(pasts, lengths, strict=True):
        t = torch.cat(row, dim=3) if row else sample.new_zeros(layers, 2, heads, 0, dim)
        rows.append(torch.nn.functional.pad(t, (0, 0, width - n, 0)) if n < width else t)
    past = torch.stack(rows, dim=2) if len(rows) > 1 else rows[0].unsqueeze(2)
    mask = torch.zeros(len(pasts), width, dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        if n:
            mask[i, width - n:] = 1
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(past[layer, 0], past[layer, 1], layer)
    return cache, mask, lengths


class PrefixReuse:
    """The engine's use of its prefix cache for sequences: what a new sequence finds, and what a prefill or a
    finished sequence leaves behind (``Seq.hashes``, ``prompt_positions`` and ``stored_blocks`` are its state)."""

    def __init__(self, cache: PrefixCache, torch: Any) -> None:
        self.cache = cache
        self.torch = torch

    def find(self, s: Seq, positions: int) -> list[Any]:
        """The cached blocks a sequence of ``positions`` prompt positions starts with (never its last position: its
        logits must be computed; none for a request that scores its prompt, which needs every position's logits)."""
        s.prompt_positions = positions
        if not self.cache.enabled:
            return []
        size = self.cache.block_size
        s.cache_on = True
        s.hashes = request_hashes(s.request, size)
        if s.request.sampling.prompt_logprobs is not None:
            return []
        blocks = self.cache.lookup(s.hashes, (positions - 1) // size, positions)
        s.stored_blocks = len(blocks)
        return blocks

    def keep(self, cache: Any, mask: Any, rows: list[Seq], finished_only: bool = False) -> None:
        """Store the full blocks of ``rows`` (row i of ``cache``) the prefix cache lacks: after a prefill, the
        prompt's; when a sequence ends (``finished_only``), those its generated tokens filled too. A failed
        sequence stores nothing."""
        if not self.cache.enabled:
            return
        size = self.cache.block_size
        for i, s in enumerate(rows):
            if s.failed or not s.cache_on or (finished_only and not s.done):
                continue
            full = s.position // size
            if full <= s.stored_blocks:
                continue
            hashes = s.hashes
            if s.position > s.prompt_positions:
                fed = s.generated[:s.position - s.prompt_positions]
                hashes = request_hashes(s.request, size, fed)
            if len(hashes) < full:
                raise ValueError(f"{len(hashes)} block hashes for {full} full blocks")
            blocks = cut_blocks(self.torch, cache, mask, i, s.stored_blocks, full, size)
            self.cache.store(hashes, s.stored_blocks, blocks, s.request.lora_adapter, block_nbytes(blocks[0]))
            s.stored_blocks = full

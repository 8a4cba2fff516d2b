"""Per-request logits processing and log-probabilities for one float32 logits row (1-D torch tensor), as the hf
engine applies them inside its continuous batch — each row with its own request's settings.

Order, as vLLM applies them: logit_bias, min_tokens (end tokens masked), repetition penalty (prompt ids and output),
frequency and presence penalties (output only), then the grammar mask (``core/structured.py``), then temperature /
top-k / top-p in the sampler. Log-probabilities are taken from the raw row, before any of this (vLLM's default
``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import TokenLogprob

__all__ = ["needs_processing", "process", "token_logprob", "prompt_logprobs"]


def needs_processing(p: SamplingParams) -> bool:
    return p.penalized or p.min_tokens > 0


def process(row: Any, p: SamplingParams, *, generated: list[int], counts: dict[int, int],
            prompt_ids: Iterable[int], eos_ids: Iterable[int]) -> Any:
    """A processed copy of ``row`` (the input is left as is, for the raw log-probabilities)."""
    import torch

    out = row.clone()
    vocab = out.shape[0]
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
        values = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=out.dtype)
        out.index_add_(0, ids, values)
    if p.min_tokens and len(generated) < p.min_tokens:
        ends = [t for t in eos_ids if 0 <= t < vocab]
        if ends:
            out[torch.tensor(ends, dtype=torch.long)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = sorted({*prompt_ids, *generated})
        if seen:
            ids = torch.tensor(seen, dtype=torch.long)
            values = out[ids]
            r = p.repetition_penalty
            out[ids] = torch.where(values > 0, values / r, values * r)
    if (p.frequency_penalty or p.presence_penalty) and counts:
        ids = torch.tensor(list(counts), dtype=torch.long)
        c = torch.tensor(list(counts.values()), dtype=out.dtype)
        out[ids] -= p.frequency_penalty * c + p.presence_penalty
    return out


def token_logprob(row: Any, token: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability under ``row`` and the ``k`` most likely (plus the chosen one)."""
    import torch

    lsm = torch.log_softmax(row.float(), dim=-1)
    return _entry(lsm, token, k)


def _entry(lsm: Any, token: int, k: int) -> TokenLogprob:
    import torch

    chosen = float(lsm[token])
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(lsm, k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    if all(t != token for t, _ in top):
        top.append((token, chosen))
    return TokenLogprob(token, chosen, tuple(top))


def prompt_logprobs(logits: Any, ids: list[int], k: int) -> tuple[TokenLogprob, ...]:
    """One entry per prompt position: ``logits[t]`` (the model's output at position t, float) predicts ``ids[t+1]``.
    Position 0 has no log-probability (nothing predicts it)."""
    import torch

    out = [TokenLogprob(ids[0], None, ())]
    for start in range(0, len(ids) - 1, 256):  # bounded memory for long prompts
        stop = min(start + 256, len(ids) - 1)
        lsm = torch.log_softmax(logits[start:stop].float(), dim=-1)
        for j in range(stop - start):
            out.append(_entry(lsm[j], ids[start + j + 1], k))
    return tuple(out)

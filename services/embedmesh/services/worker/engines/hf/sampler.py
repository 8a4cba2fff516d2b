"""How the hf engine turns a step's logits into tokens: per-row logits processors (``logits.py``), grammar masks
(``core/structured.py``), temperature / top-k / top-p sampling, log-probabilities, and the stop rules that end a
sequence and stream its text.

Sampling never yields NaN probabilities: it is computed in float32 on max-shifted logits, temperatures below
``GREEDY_BELOW`` are greedy, and a distribution that still is not finite falls back to greedy. A row whose logits
are NaN, +Inf or all -Inf fails alone (NON_FINITE_COMPUTATION), as does a row whose sampling raises."""

from __future__ import annotations

import math
from typing import Any

from embedmesh.core.errors import InternalError, InvalidArgument
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    EngineStats,
    FinishReason,
    GenerationDelta,
    TokenLogprob,
    TokenSegment,
)
from embedmesh.services.worker.engines.hf import logits as logits_ops
from embedmesh.services.worker.engines.hf.runner import ModelRunner
from embedmesh.services.worker.engines.hf.sequence import Seq

__all__ = ["Sampler", "GREEDY_BELOW", "step_seed"]

log = get_logger(__name__)

GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (vLLM's convention): dividing logits by them overflows float32."""


def step_seed(seed: int, step: int) -> int:
    """The generator seed of step ``step`` (tokens generated before it) of a sequence seeded with ``seed``: a
    64-bit mix of both, so a sequence continued elsewhere after ``step`` tokens draws what it would have drawn."""
    x = (seed + step * 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


class Sampler:
    """Reads the runner's tokenizer, end-of-sequence ids and model info (all set once the model is loaded)."""

    def __init__(self, runner: ModelRunner, stats: EngineStats) -> None:
        self._runner = runner
        self._stats = stats
        self._structured: Any = None
        """``StructuredCompiler`` for this tokenizer, built on first use (in the engine thread)."""

    def prepare(self, s: Seq) -> None:
        """A new sequence's random generator and grammar matcher; a resumed one's (a migrated stream) state as if
        it had generated its resumed tokens itself: penalty counts, the grammar advanced past them."""
        torch = self._runner.torch
        s.generator = torch.Generator()
        if s.request.sampling.seed is None:
            s.generator.seed()
        if s.request.sampling.structured is not None:
            s.matcher = self._compiler().matcher(s.request.sampling.structured)
        p = s.request.sampling
        for token in s.request.resumed:
            if p.frequency_penalty or p.presence_penalty:
                s.counts[token] = s.counts.get(token, 0) + 1
            if s.matcher is not None and not s.matcher.accept(token):
                raise InvalidArgument("resume_token_ids: the resumed tokens break the structured-output constraint",
                                      field="resume_token_ids", reason="RESUME_BREAKS_GRAMMAR")

    def _compiler(self) -> Any:
        if self._structured is None:
            from embedmesh.core.structured import StructuredCompiler

            assert self._runner.info is not None
            self._structured = StructuredCompiler(self._runner.tokenizer, self._runner.info.vocab_size)
        return self._structured

    def sample_rows(self, logits: Any, seqs: list[Seq]) -> None:
        """Sample and accept one token per live row of ``logits`` (float32, one row per sequence); a row that is
        not finite, or whose sampling raises, fails alone."""
        torch = self._runner.torch
        # max() propagates NaN and keeps +Inf; a row of only -Inf has no token to pick: one reduction finds all.
        bad = (~torch.isfinite(logits.max(dim=-1).values)).tolist()
        for i, s in enumerate(seqs):
            if s.done or s.aborted:
                continue
            if bad[i]:
                log.warning("non-finite logits; failing the request", extra={"request_id": s.request.request_id})
                s.fail(_non_finite(s))
                continue
            try:
                self._step_row(logits[i], s)
            except Exception as e:  # noqa: BLE001 - this row alone
                log.exception("sampling failed", extra={"request_id": s.request.request_id})
                s.fail(e)

    def _step_row(self, raw: Any, s: Seq) -> None:
        """Process one sequence's logits row (penalties, bias, grammar), sample, record its log-probability."""
        p = s.request.sampling
        row = raw
        if logits_ops.needs_processing(p):
            prompt_ids = (t for g in s.request.segments if isinstance(g, TokenSegment) for t in g.ids)
            generated = [*s.request.resumed, *s.generated] if s.request.resumed else s.generated
            row = logits_ops.process(raw, p, generated=generated, counts=s.counts, prompt_ids=prompt_ids,
                                     eos_ids=self._runner.eos_ids)
        if s.matcher is not None:
            row = row.clone() if row is raw else row
            s.matcher.mask(row)
            if not bool(self._runner.torch.isfinite(row.max())):
                raise InternalError("the structured-output constraint allows no token here")
        token = self.sample(row, s)
        lp = logits_ops.token_logprob(raw, token, p.logprobs) if p.logprobs is not None else None
        if s.matcher is not None and not s.matcher.accept(token):
            raise InternalError("the sampled token breaks the structured-output constraint")
        self._accept(s, token, lp)

    def sample(self, logits: Any, s: Seq) -> int:
        """One token from a finite float32 logits row. Never builds NaN/Inf probabilities: the row is shifted so
        its maximum is 0 before the temperature divides it (softmax of values <= 0 with one 0 cannot overflow or be
        all zero), and whatever still is not a distribution falls back to greedy."""
        torch = self._runner.torch
        p = s.request.sampling
        if p.temperature < GREEDY_BELOW or p.top_k == 1:
            return int(torch.argmax(logits))
        z = (logits - logits.max()) / p.temperature
        if p.top_k and p.top_k < z.shape[-1]:
            kth = torch.topk(z, p.top_k).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, dim=-1)
        if p.seed is not None:  # each step's draw depends on the seed and the step alone: a resumed sequence
            s.generator.manual_seed(step_seed(p.seed, len(s.request.resumed) + len(s.generated)))  # continues it
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # The most likely token is always kept (its preceding mass is 0 < top_p), so the sum below is > 0.
            cut = cumulative - sorted_probs > p.top_p
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            probs = probs / probs.sum()
        total = float(probs.sum())
        if not (math.isfinite(total) and total > 0.0) or not bool(torch.isfinite(probs).all()):
            return int(torch.argmax(logits))
        return int(torch.multinomial(probs, 1, generator=s.generator))

    def _accept(self, s: Seq, token: int, lp: TokenLogprob | None = None) -> None:
        """Record a sampled token, stream its text, finish the sequence if a stop rule fires."""
        p = s.request.sampling
        s.generated.append(token)
        if lp is not None:
            s.logprobs.append(lp)
        if p.frequency_penalty or p.presence_penalty:
            s.counts[token] = s.counts.get(token, 0) + 1
        s.pending = token
        self._stats.generated_tokens += 1
        finish: FinishReason | None = None
        grammar_done = s.matcher is not None and s.matcher.is_terminated()
        assert self._runner.info is not None
        if token in self._runner.eos_ids and (not p.ignore_eos or grammar_done):
            finish = FinishReason.STOP
            text, stopped = s.detok.finish()
        else:
            text, stopped = s.detok.add(token)
            if stopped:
                finish = FinishReason.STOP
            elif len(s.generated) >= p.max_tokens or s.position + 1 >= self._runner.info.max_context_tokens:
                finish = FinishReason.LENGTH
            if finish is FinishReason.LENGTH:
                more, _ = s.detok.finish()
                text += more
        if finish is not None:
            s.done = True
            self._stats.completed_requests += 1
        if text or finish is not None:
            start = s.detok.emitted_tokens
            ids = tuple(s.generated[start:])
            s.detok.emitted_tokens = len(s.generated)
            lps = tuple(s.logprobs[start:]) if p.logprobs is not None else ()
            s.emit(GenerationDelta(text, ids, len(s.generated), finish, lps, s.prompt_lp))
            s.prompt_lp = None

    def score_prompt(self, s: Seq, logits: Any, n: int) -> None:
        """Prompt log-probabilities for ``s`` (token-id prompts only: the worker's validation refuses embeddings);
        with ``max_tokens == 0`` the sequence ends here, having generated nothing."""
        ids = [t for g in s.request.segments if isinstance(g, TokenSegment) for t in g.ids]
        try:
            s.prompt_lp = logits_ops.prompt_logprobs(logits[: n - 1], ids, s.request.sampling.prompt_logprobs or 0)
        except Exception as e:  # noqa: BLE001 - this sequence alone
            log.exception("prompt log-probabilities failed", extra={"request_id": s.request.request_id})
            s.fail(e)
            return
        if s.request.sampling.max_tokens == 0 and not s.done:
            s.done = True
            self._stats.completed_requests += 1
            s.emit(GenerationDelta("", (), 0, FinishReason.LENGTH, prompt_logprobs=s.prompt_lp))
            s.prompt_lp = None


def _non_finite(s: Seq) -> InvalidArgument:
    field = "prompt_embeds" if any(isinstance(g, EmbedsSegment) for g in s.request.segments) else "prompt"
    return InvalidArgument(
        f"{field}: the model's computation went non-finite (NaN or Inf) for this prompt; check the magnitudes "
        "of the input values", field=field, reason="NON_FINITE_COMPUTATION")

"""Continuing a migrated stream on vLLM (``GenerationRequest.resumed``: the token ids the client already got).

vLLM is told the resumed tokens as more prompt: after a text prompt's ids as ids, after a prompt holding embeddings
(``prompt_embeds``, chat embedding parts) as their own rows of the model's embedding table, which is what the model's
embedding layer gives for those ids (the engine already sends the token pieces of mixed prompts that way). Greedy
decoding then continues with the undisturbed text. What vLLM counts as *output* does not see them, so:

- ``min_tokens`` is reduced by them (EOS stays blocked exactly as long as in the undisturbed run);
- stop strings and the text held back (a trailing partial character, the last ``len(longest stop) - 1`` characters
  while stop strings are set) are handled here, by vLLM's own incremental detokenizer built for the original
  request and fed the resumed tokens first: the text they released went to the client already, what they held back
  comes out first, and a stop string across the cut is found (vLLM is then run without stop strings and without
  detokenizing, and aborted when the stop string ends the sequence);
- what cannot be made exact is refused (``refusal``): a seed with random sampling (vLLM seeds its generator once per
  request and offers no offset), presence and frequency penalties (they count output tokens only, and their sum over
  the resumed and the new tokens is not a logit bias), a repetition penalty after embedding rows (vLLM sees no ids
  for rows), structured outputs (vLLM's grammar starts at the first output token).

Log-probabilities of the new tokens are allowed: each is the model's log-softmax at its position, the same
computation as in the undisturbed run. Unseeded random sampling is allowed: there is no undisturbed text to equal,
and the continuation draws from the same conditional distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from embedmesh.core.errors import FailedPrecondition
from embedmesh.services.worker.engines.base import EmbedsSegment, FinishReason, GenerationRequest

__all__ = ["GREEDY_BELOW", "ResumedText", "check_resumable", "detokenizer_request", "refusal", "resumed_detokenizer",
           "sampling_overrides"]

GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature (its ``_SAMPLING_EPS``)."""


def refusal(request: GenerationRequest) -> tuple[str, str] | None:
    """(field, why) when vLLM cannot continue ``request`` exactly as the undisturbed run, else None."""
    p = request.sampling
    if p.seed is not None and p.temperature >= GREEDY_BELOW and p.top_k != 1:
        return "seed", ("vLLM seeds a request's random generator once and cannot continue it at the resumed "
                        "tokens' offset")
    if p.presence_penalty:
        return "presence_penalty", "vLLM counts only output tokens for the presence penalty, not the resumed ones"
    if p.frequency_penalty:
        return "frequency_penalty", "vLLM counts only output tokens for the frequency penalty, not the resumed ones"
    if p.repetition_penalty != 1.0 and any(isinstance(s, EmbedsSegment) for s in request.segments):
        return "repetition_penalty", ("after embedding rows vLLM sees no token ids, so the repetition penalty "
                                      "would not see the resumed tokens")
    if p.structured is not None:
        return "structured_outputs", "vLLM's grammar starts at the first output token and cannot skip the resumed ones"
    return None


def check_resumable(request: GenerationRequest) -> None:
    """Refuse (FAILED_PRECONDITION ``RESUME_UNSUPPORTED``, naming the sampling field) what vLLM cannot continue."""
    why = refusal(request)
    if why is not None:
        field, reason = why
        raise FailedPrecondition(f"resume_token_ids: the vllm engine cannot continue this generation exactly: "
                                 f"{field}: {reason}", field=field, reason="RESUME_UNSUPPORTED")


def sampling_overrides(request: GenerationRequest) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields that differ for a resumed request: ``min_tokens`` less the resumed tokens, no
    stop strings and no detokenizing (``ResumedText`` does both with the resumed tokens in view)."""
    if not request.resumed:
        return {}
    return {"min_tokens": max(request.sampling.min_tokens - len(request.resumed), 0), "stop": None,
            "detokenize": False}


def detokenizer_request(request: GenerationRequest, prompt_ids: Sequence[int] | None, prompt_embeds: Any) -> Any:
    """What vLLM's ``IncrementalDetokenizer.from_new_request`` reads, for the request as the first worker sent it
    (its prompt without the resumed tokens; the original stop strings and ``min_tokens``)."""
    p = request.sampling
    params = SimpleNamespace(stop=list(p.stop) or None, min_tokens=p.min_tokens, include_stop_str_in_output=False,
                             skip_special_tokens=True, spaces_between_special_tokens=True, detokenize=True)
    return SimpleNamespace(request_id=request.request_id, sampling_params=params,
                           prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None,
                           prompt_embeds=prompt_embeds)


class ResumedText:
    """The text of a resumed sequence, from a vLLM incremental detokenizer (``update`` / ``get_next_output_text`` /
    ``output_token_ids``) that first takes the resumed tokens (their released text is dropped: the client has it)."""

    def __init__(self, detokenizer: Any, resumed: Sequence[int]) -> None:
        self._d = detokenizer
        self.stopped_early = self._d.update(list(resumed), False) is not None
        """A stop string is already in the resumed tokens' text (the cut came after the sequence ended)."""
        self._d.get_next_output_text(False, True)
        self._count = len(self._d.output_token_ids)

    def held(self) -> str:
        """The resumed tokens' held-back text, for a sequence that ends at once (``stopped_early``)."""
        return self._d.get_next_output_text(True, True)

    def step(self, token_ids: Sequence[int], vllm_finish: FinishReason | None) -> tuple[str, tuple[int, ...],
                                                                                       FinishReason | None]:
        """New ids from vLLM and its finish (None while running) -> (text, the ids kept, finish): a stop string
        ends the sequence at the token completing it (finish STOP; vLLM must then be aborted)."""
        stop = self._d.update(list(token_ids), vllm_finish is FinishReason.STOP)
        finish = FinishReason.STOP if stop is not None else vllm_finish
        ids = self._d.output_token_ids
        kept = tuple(ids[self._count:])
        self._count = len(ids)
        return self._d.get_next_output_text(finish is not None, True), kept, finish


def resumed_detokenizer(tokenizer: Any, request: GenerationRequest, prompt_ids: Sequence[int] | None,
                        prompt_embeds: Any, build: Callable[[Any, Any], Any] | None = None) -> ResumedText:
    """vLLM's own incremental detokenizer for ``request`` (``build`` stands in for it in tests)."""
    if build is None:
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        build = IncrementalDetokenizer.from_new_request
    return ResumedText(build(tokenizer, detokenizer_request(request, prompt_ids, prompt_embeds)), request.resumed)

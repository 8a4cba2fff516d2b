"""What a worker checks before a request reaches its engine, whatever sent it (the preprocessor, or any holder of a
mesh certificate calling ``WorkerService.Generate`` directly): engines rely on these rules and never see a request
that breaks one.

Each refusal is an InvalidArgument naming the field and the rule (reason in parentheses):
- the model generates text (WRONG_TASK)
- the prompt has at least one position (EMPTY_PROMPT)
- token ids are in ``[0, vocab_size)`` (TOKEN_OUT_OF_RANGE)
- embedding rows: every rule of ``core.embeds.validate_embeds`` — float dtype, ``(rows, hidden_size)``,
  at least one row, finite after the cast to the model dtype (UNSUPPORTED_DTYPE, BAD_RANK, HIDDEN_SIZE_MISMATCH,
  EMPTY_EMBEDS, NON_FINITE) — checked where the wire dtype is still known (``embeds_from_wire``)
- prompt + max_tokens fit the model's context (CONTEXT_OVERFLOW, the rule of ``core.context``)
- logit_bias token ids are in the vocabulary (TOKEN_OUT_OF_RANGE, field logit_bias)
- prompt log-probabilities only for prompts made of token ids (PROMPT_LOGPROBS_WITH_EMBEDS), and not with resumed
  tokens (PROMPT_LOGPROBS_WITH_RESUME: the first worker sent them)
- resumed token ids are in the vocabulary (TOKEN_OUT_OF_RANGE, field resume_token_ids); the context counts them
Sampling ranges are checked by ``embedmesh.core.sampling.sampling_from_proto`` and the vocabulary rule by
``embedmesh.core.model_rules.check_sampling_for_model``, the rules the preprocessor uses too.
"""

from __future__ import annotations

import numpy as np

from embedmesh.core import tensors
from embedmesh.core.context import REQUEST, check_context
from embedmesh.core.embeds import ModelSpec, validate_embeds
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.model_rules import check_sampling_for_model
from embedmesh.services.worker.engines.base import EmbedsSegment, GenerationRequest, ModelInfo, TokenSegment

__all__ = ["check_task", "check_generation", "embeds_from_wire"]

_ROW_DTYPES = tensors.float_storage_dtypes()
"""numpy dtypes an EmbedsSegment may hold (uint16: bf16 bits, see ``EmbedsSegment``), from ``tensors.DTYPES``."""


def embeds_from_wire(arr: np.ndarray, dtype: int, info: ModelInfo, *, max_tokens: int,
                     field: str = "prompt_embeds", scanned: bool = False) -> np.ndarray:
    """Rows received as ``dtype`` (a DataType) -> a ``(rows, hidden_size)`` array in the model dtype, after every
    embeddings rule; the same function the preprocessor applies, so both ends agree on each bound. ``scanned``: the
    rows passed the NaN/Inf check as they arrived (``worker/chunks.py``), in the model dtype."""
    spec = ModelSpec(info.hidden_size, info.max_context_tokens, tensors.dtype_from_name(info.dtype))
    return validate_embeds(arr, dtype, spec, field=field, max_tokens=max_tokens,
                           scanned=scanned and dtype == spec.dtype)


def check_task(info: ModelInfo) -> None:
    """Generate only reaches models that generate text."""
    if info.task != "generate":
        raise InvalidArgument(f"model: {info.model} is an embedding model; use /v1/embeddings", field="model",
                              reason="WRONG_TASK")


def check_generation(request: GenerationRequest, info: ModelInfo) -> None:
    """The cheap structural rules (no scan of embedding values): task, empty prompt, token ids, row shape and
    dtype, context. Engines call it too, so a caller inside the process gets the same answers."""
    check_task(info)
    if request.prompt_len == 0:
        raise InvalidArgument("prompt: the prompt is empty; send at least one token or embedding row",
                              field="prompt", reason="EMPTY_PROMPT")
    for seg in request.segments:
        if isinstance(seg, TokenSegment):
            bad = next((t for t in seg.ids if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"prompt: token id {bad} is outside the vocabulary [0, {info.vocab_size})",
                                      field="prompt", reason="TOKEN_OUT_OF_RANGE")
        elif isinstance(seg, EmbedsSegment):
            rows = seg.rows
            if rows.dtype not in _ROW_DTYPES:
                raise InvalidArgument(f"prompt_embeds: dtype {rows.dtype} is not accepted; send float embeddings",
                                      field="prompt_embeds", reason="UNSUPPORTED_DTYPE")
            if rows.ndim != 2 or rows.shape[1] != info.hidden_size:
                raise InvalidArgument(
                    f"prompt_embeds: expected a (rows, {info.hidden_size}) tensor, got shape {list(rows.shape)}",
                    field="prompt_embeds", reason="BAD_SHAPE")
    bad = next((t for t in request.resumed if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"resume_token_ids: token id {bad} is outside the vocabulary [0, {info.vocab_size})",
                              field="resume_token_ids", reason="TOKEN_OUT_OF_RANGE")
    if request.resumed and request.sampling.prompt_logprobs is not None:
        raise InvalidArgument("prompt_logprobs: a resumed generation does not score its prompt again",
                              field="prompt_logprobs", reason="PROMPT_LOGPROBS_WITH_RESUME")
    check_sampling_for_model(request.sampling, info.vocab_size)
    if request.sampling.prompt_logprobs is not None and any(isinstance(g, EmbedsSegment) for g in request.segments):
        raise InvalidArgument("prompt_logprobs: log-probabilities of the prompt need token ids; embedding rows have "
                              "no token to score (send a text or token-id prompt)", field="prompt_logprobs",
                              reason="PROMPT_LOGPROBS_WITH_EMBEDS")
    check_context(request.positions, request.sampling.max_tokens, info.max_context_tokens, field="max_tokens",
                  wording=REQUEST)

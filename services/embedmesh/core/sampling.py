"""Sampling parameters: the resolved domain type and its conversion from the proto, with server defaults and
range checks in one place so the preprocessor (early, before fan-out) and every worker agree."""

from __future__ import annotations

import math
from dataclasses import dataclass

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import InvalidArgument

__all__ = [
    "SamplingParams",
    "Structured",
    "sampling_from_proto",
    "sampling_to_proto",
    "choice_seed",
    "DEFAULT_MAX_TOKENS",
    "SEED_MIN",
    "SEED_MAX",
    "MAX_LOGPROBS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP",
    "TEMPERATURE_MIN",
    "TEMPERATURE_MAX",
    "TOP_P_MAX",
    "PENALTY_MIN",
    "PENALTY_MAX",
    "REPETITION_PENALTY_MAX",
    "LOGIT_BIAS_MIN",
    "LOGIT_BIAS_MAX",
    "TEMPERATURE_RANGE",
]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's completions default."""
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
"""``seed`` is any int64, as in OpenAI's API (and the proto field)."""
MAX_LOGPROBS = 20
"""Most alternatives per position (OpenAI's bound for top_logprobs; completions' logprobs allows 5, vLLM 20)."""
MAX_LOGIT_BIAS = 300
"""Most entries in logit_bias (OpenAI's own limit)."""
MAX_STOP = 16
"""Most stop strings."""
TEMPERATURE_MIN = 0.0
TEMPERATURE_MAX = 100.0
"""``temperature`` in [TEMPERATURE_MIN, TEMPERATURE_MAX]; 0 is greedy."""
TEMPERATURE_RANGE = f"temperature must be in [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]"
"""The refusal of a temperature out of range (the preprocessor's and the gateway's words)."""
TOP_P_MAX = 1.0
"""``top_p`` in (0, TOP_P_MAX]."""
PENALTY_MIN = -2.0
PENALTY_MAX = 2.0
"""``presence_penalty`` and ``frequency_penalty`` in [PENALTY_MIN, PENALTY_MAX] (OpenAI's range)."""
REPETITION_PENALTY_MAX = 2.0
"""``repetition_penalty`` in (0, REPETITION_PENALTY_MAX]; 1 = none."""
LOGIT_BIAS_MIN = -100.0
LOGIT_BIAS_MAX = 100.0
"""Each ``logit_bias`` value in [LOGIT_BIAS_MIN, LOGIT_BIAS_MAX] (OpenAI's range)."""


@dataclass(frozen=True)
class Structured:
    """What the output must match (constrained decoding); exactly one ``kind``."""

    kind: str
    """"json_schema", "json_object", "regex", "choice" or "grammar"."""
    value: str | tuple[str, ...] = ""
    """The schema (JSON text), the regex, the grammar, or the choices; "" for json_object."""


@dataclass(frozen=True)
class SamplingParams:
    """Resolved sampling controls (server defaults already applied)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """1 = none."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, sorted by id."""
    logprobs: int | None = None
    """None = no log-probabilities; k = the chosen token's and the k most likely alternatives'."""
    prompt_logprobs: int | None = None
    """None = none; k = each prompt token's and k alternatives' (token-id prompt positions only)."""
    structured: Structured | None = None
    min_tokens: int = 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``seed``: ``seed + index`` wrapped into the int64 range, so the
    ``n`` choices of one request differ, a repeated request gives the same texts, and ``SEED_MAX`` with ``n > 1``
    still fits the proto field (it wraps to ``SEED_MIN``)."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


def _penalty(p: common_pb2.SamplingParams, name: str, default: float, low: float, high: float,
             low_open: bool = False) -> float:
    if not p.HasField(name):
        return default
    v = float(getattr(p, name))
    ok = math.isfinite(v) and (low < v if low_open else low <= v) and v <= high
    if not ok:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidArgument(f"{name} must be in {bound}", field=name, reason="OUT_OF_RANGE")
    return v


def _structured(p: common_pb2.SamplingParams) -> Structured | None:
    kind = p.structured.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return Structured("json_object") if p.structured.json_object else None
    if kind == "choice":
        values = tuple(p.structured.choice.values)
        if not values:
            raise InvalidArgument("structured_outputs.choice must list at least one string",
                                  field="structured_outputs.choice", reason="EMPTY")
        return Structured("choice", values)
    value = getattr(p.structured, kind)
    if not value:
        raise InvalidArgument(f"structured_outputs.{kind} must not be empty", field=f"structured_outputs.{kind}",
                              reason="EMPTY")
    return Structured(kind, value)


def sampling_from_proto(p: common_pb2.SamplingParams, *, allow_zero_max_tokens: bool = False) -> SamplingParams:
    """Apply defaults to unset fields and check ranges; errors name the field as clients spell it.

    ``max_tokens: 0`` is only meaningful when the prompt's log-probabilities are asked for (echo scoring);
    ``allow_zero_max_tokens`` lets the caller allow it then."""
    max_tokens = p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    prompt_logprobs = int(p.prompt_logprobs) if p.HasField("prompt_logprobs") else None
    if max_tokens < 1 and not (max_tokens == 0 and (allow_zero_max_tokens or prompt_logprobs is not None)):
        raise InvalidArgument("max_tokens must be >= 1", field="max_tokens", reason="OUT_OF_RANGE")
    if not math.isfinite(temperature) or not TEMPERATURE_MIN <= temperature <= TEMPERATURE_MAX:
        raise InvalidArgument(TEMPERATURE_RANGE, field="temperature", reason="OUT_OF_RANGE")
    if not math.isfinite(top_p) or not 0.0 < top_p <= TOP_P_MAX:
        raise InvalidArgument(f"top_p must be in (0, {TOP_P_MAX:g}]", field="top_p", reason="OUT_OF_RANGE")
    if len(p.stop) > MAX_STOP:
        raise InvalidArgument(f"at most {MAX_STOP} stop strings", field="stop", reason="TOO_MANY_STOP")
    logprobs = int(p.logprobs) if p.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}]", field="logprobs", reason="OUT_OF_RANGE")
    if prompt_logprobs is not None and prompt_logprobs > MAX_LOGPROBS:
        raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", field="prompt_logprobs",
                              reason="OUT_OF_RANGE")
    bias = _logit_bias(p)
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(p.top_k) if p.HasField("top_k") else 0,
        seed=int(p.seed) if p.HasField("seed") else None,
        stop=tuple(s for s in p.stop if s),
        ignore_eos=p.ignore_eos,
        presence_penalty=_penalty(p, "presence_penalty", 0.0, PENALTY_MIN, PENALTY_MAX),
        frequency_penalty=_penalty(p, "frequency_penalty", 0.0, PENALTY_MIN, PENALTY_MAX),
        repetition_penalty=_penalty(p, "repetition_penalty", 1.0, 0.0, REPETITION_PENALTY_MAX, low_open=True),
        logit_bias=tuple(bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=_structured(p),
        min_tokens=int(p.min_tokens) if p.HasField("min_tokens") else 0,
    )


def _logit_bias(p: common_pb2.SamplingParams) -> list[tuple[int, float]]:
    """``logit_bias`` checked (entries, ids, range) as sorted (token id, bias) pairs."""
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", field="logit_bias",
                              reason="TOO_MANY")
    bias = []
    for token, value in sorted(p.logit_bias.items()):
        if token < 0:
            raise InvalidArgument(f"logit_bias: token id {token} is negative", field="logit_bias",
                                  reason="INVALID_TOKEN_ID")
        if not math.isfinite(value) or not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX:
            raise InvalidArgument(f"logit_bias: the bias of token {token} must be in [{LOGIT_BIAS_MIN:g}, "
                                  f"{LOGIT_BIAS_MAX:g}]",
                                  field="logit_bias", reason="OUT_OF_RANGE")
        bias.append((int(token), float(value)))
    return bias


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    """The resolved params as the proto a worker receives (defaults explicit)."""
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, stop=list(s.stop), ignore_eos=s.ignore_eos
    )
    if s.top_k:
        p.top_k = s.top_k
    if s.seed is not None:
        p.seed = s.seed
    if s.presence_penalty:
        p.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        p.frequency_penalty = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        p.repetition_penalty = s.repetition_penalty
    for token, bias in s.logit_bias:
        p.logit_bias[token] = bias
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.min_tokens:
        p.min_tokens = s.min_tokens
    st = s.structured
    if st is not None:
        if st.kind == "json_object":
            p.structured.json_object = True
        elif st.kind == "choice":
            p.structured.choice.values.extend(st.value)
        else:
            setattr(p.structured, st.kind, st.value)
    return p

"""Sampling parameters: the resolved domain type and its conversion from the proto, with server defaults and
range checks in one place so the preprocessor (early, before fan-out) and every worker agree."""

from __future__ import annotations

import math
from dataclasses import dataclass

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import InvalidArgument

__all__ = ["SamplingParams", "sampling_from_proto", "choice_seed", "DEFAULT_MAX_TOKENS", "SEED_MIN", "SEED_MAX"]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's completions default."""
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
"""``seed`` is any int64, as in OpenAI's API (and the proto field)."""


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


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``seed``: ``seed + index`` wrapped into the int64 range, so the
    ``n`` choices of one request differ, a repeated request gives the same texts, and ``SEED_MAX`` with ``n > 1``
    still fits the proto field (it wraps to ``SEED_MIN``)."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Apply defaults to unset fields and check ranges; errors name the field as clients spell it."""
    max_tokens = p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if max_tokens < 1:
        raise InvalidArgument("max_tokens must be >= 1", field="max_tokens", reason="OUT_OF_RANGE")
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 100.0:
        raise InvalidArgument("temperature must be in [0, 100]", field="temperature", reason="OUT_OF_RANGE")
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p must be in (0, 1]", field="top_p", reason="OUT_OF_RANGE")
    if len(p.stop) > 16:
        raise InvalidArgument("at most 16 stop strings", field="stop", reason="TOO_MANY_STOP")
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(p.top_k) if p.HasField("top_k") else 0,
        seed=int(p.seed) if p.HasField("seed") else None,
        stop=tuple(s for s in p.stop if s),
        ignore_eos=p.ignore_eos,
    )

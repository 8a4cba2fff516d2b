"""Choosing a worker: cost = prefill_weight x blocks still to prefill + decode_weight x active requests.

Lowest cost wins; ties are broken at random; with ``temperature > 0`` the choice is sampled from
softmax(-cost / temperature) instead, which spreads load when costs are close.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["Weights", "Scored", "score", "choose"]


@dataclass(frozen=True)
class Weights:
    prefill: float = 1.0
    """Cost of one block the chosen worker must still prefill."""
    decode: float = 1.0
    """Cost of one request the worker is already running."""
    temperature: float = 0.0
    """0 = always the cheapest; > 0 samples from softmax(-cost / temperature)."""


@dataclass(frozen=True)
class Scored:
    worker_id: str
    overlap: int
    active: int
    cost: float


def score(prompt_blocks: int, overlaps: dict[str, int], loads: dict[str, int], w: Weights) -> list[Scored]:
    """Every candidate's cost, cheapest first (ties in a stable order)."""
    out = [
        Scored(wid, overlaps.get(wid, 0), active,
               w.prefill * (prompt_blocks - overlaps.get(wid, 0)) + w.decode * active)
        for wid, active in loads.items()
    ]
    out.sort(key=lambda s: (s.cost, s.worker_id))
    return out


def choose(scored: list[Scored], w: Weights, rng: random.Random) -> Scored:
    if not scored:
        raise ValueError("no candidates")
    if w.temperature > 0:
        best = scored[0].cost
        weights = [math.exp(-(s.cost - best) / w.temperature) for s in scored]
        return rng.choices(scored, weights=weights, k=1)[0]
    ties = [s for s in scored if s.cost == scored[0].cost]
    return rng.choice(ties)

"""Choosing a worker: cost = prefill_weight x blocks still to prefill + decode_weight x decode load.

Blocks still to prefill are the prompt's blocks minus the worker's cached prefix (its overlap); decode load is the
requests it runs (last heartbeat) plus those routed to it since. The two weights put blocks and requests on one
scale: with the defaults one running request costs as much as prefilling ``decode / prefill`` blocks.

Lowest cost wins; ties are broken at random; with ``temperature > 0`` the choice is sampled from
softmax(-cost / temperature) instead, which spreads load when costs are close.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["MODES", "Weights", "Scored", "score", "choose", "choose_blind"]

MODES = ("kv", "round-robin", "random")
"""Router selection modes: the cost policy, and two baselines that ignore cache and load."""


@dataclass(frozen=True)
class Weights:
    """The cost model's knobs (router flags ``--prefill-weight``, ``--decode-weight``, ``--temperature``)."""

    prefill: float = 1.0
    """Cost of one block the chosen worker must still prefill."""
    decode: float = 1.0
    """Cost of one request the worker is already running."""
    temperature: float = 0.0
    """0 = always the cheapest; > 0 samples from softmax(-cost / temperature)."""

    def __post_init__(self) -> None:
        if not (self.prefill >= 0 and self.decode >= 0 and self.temperature >= 0):
            raise ValueError(f"weights and temperature must be >= 0, got {self}")


@dataclass(frozen=True)
class Scored:
    """One candidate's cost and what went into it."""

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
    """The cheapest candidate (a random one among equals), or a softmax sample when ``w.temperature > 0``."""
    if not scored:
        raise ValueError("no candidates")
    if w.temperature > 0:
        best = scored[0].cost
        weights = [math.exp(-(s.cost - best) / w.temperature) for s in scored]
        return rng.choices(scored, weights=weights, k=1)[0]
    ties = [s for s in scored if s.cost == scored[0].cost]
    return rng.choice(ties)


def choose_blind(scored: list[Scored], mode: str, turn: int, rng: random.Random) -> Scored:
    """A baseline's pick, blind to cost: the ``turn``-th worker in worker-id order ("round-robin") or any one
    ("random")."""
    if not scored:
        raise ValueError("no candidates")
    ordered = sorted(scored, key=lambda s: s.worker_id)
    if mode == "round-robin":
        return ordered[turn % len(ordered)]
    if mode == "random":
        return rng.choice(ordered)
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")

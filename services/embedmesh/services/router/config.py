"""Router configuration: one typed dataclass; CLI flags and ``EMBEDMESH_ROUTER_*`` env vars are read here only.

Each field is a flag ``--field-name`` and a variable ``EMBEDMESH_ROUTER_<FIELD>`` (``embedmesh.core.config``;
``--help`` lists them); ``--approx-ttl`` and ``EMBEDMESH_ROUTER_APPROX_TTL`` keep working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embedmesh.core.config import Settings, option
from embedmesh.services.router.scoring import MODES, Weights

__all__ = ["RouterConfig"]


@dataclass(frozen=True)
class RouterConfig(Settings, service="router", prog="embedmesh-router", description="Run the KV-aware router."):
    """Where the router listens, its cost policy and how long it trusts what workers told it."""

    host: str = "127.0.0.1"
    """Interface to bind (0.0.0.0 in containers)."""
    port: int = 50081
    """gRPC port (0 = any free port)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    prefill_weight: float = 1.0
    """Cost of one prompt block the worker must still prefill."""
    decode_weight: float = 1.0
    """Cost of one request the worker is already running (in prefill-block units via the two weights)."""
    temperature: float = 0.0
    """0 = always the cheapest worker; > 0 samples from softmax(-cost / temperature)."""
    stale_seconds: float = 3.0
    """A worker silent this long (no heartbeat, no event) is dropped with its blocks; workers beat every second."""
    sweep_seconds: float = 0.5
    """How often silent workers and expired approximate blocks are looked for."""
    approx_ttl_seconds: float = option(120.0, flags=("--approx-ttl",), aliases=("EMBEDMESH_ROUTER_APPROX_TTL",))
    """Workers without KV events: a routed block is assumed cached this long after it was last routed there."""
    approx_max_blocks: int = 100_000
    """Workers without KV events: most blocks assumed cached per worker (oldest forgotten first)."""
    seed: int | None = None
    """Seed of the tie-breaking / softmax random generator (None = from the OS)."""
    mode: str = option("kv", choices=MODES)
    """How a worker is chosen: "kv" (cached prefix against load, the cost above), or the baselines it is measured
    against, "round-robin" and "random" (the KV index is still kept and each decision's overlap still reported)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("port and metrics_port must be in [0, 65535]")
        for name in ("prefill_weight", "decode_weight", "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.stale_seconds > 0 or not self.sweep_seconds > 0 or not self.approx_ttl_seconds > 0:
            raise ValueError("stale_seconds, sweep_seconds and approx_ttl_seconds must be > 0")
        if self.approx_max_blocks < 1:
            raise ValueError("approx_max_blocks must be >= 1")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def weights(self) -> Weights:
        return Weights(self.prefill_weight, self.decode_weight, self.temperature)

"""Router configuration: one typed dataclass; CLI flags and ``EMBEDMESH_ROUTER_*`` env vars are read here only."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass

from embedmesh.services.router.scoring import Weights

__all__ = ["RouterConfig"]


@dataclass(frozen=True)
class RouterConfig:
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
    approx_ttl_seconds: float = 120.0
    """Workers without KV events: a routed block is assumed cached this long after it was last routed there."""
    approx_max_blocks: int = 100_000
    """Workers without KV events: most blocks assumed cached per worker (oldest forgotten first)."""
    seed: int | None = None
    """Seed of the tie-breaking / softmax random generator (None = from the OS)."""

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

    @property
    def weights(self) -> Weights:
        return Weights(self.prefill_weight, self.decode_weight, self.temperature)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> RouterConfig:
        env = os.environ
        d = cls()

        def e(name: str, default: object) -> str:
            return env.get(f"EMBEDMESH_ROUTER_{name}", str(default))

        p = argparse.ArgumentParser(prog="embedmesh-router", description="Run the KV-aware router.")
        p.add_argument("--host", default=e("HOST", d.host))
        p.add_argument("--port", type=int, default=int(e("PORT", d.port)))
        p.add_argument("--metrics-port", type=int, default=int(e("METRICS_PORT", d.metrics_port)))
        p.add_argument("--prefill-weight", type=float, default=float(e("PREFILL_WEIGHT", d.prefill_weight)))
        p.add_argument("--decode-weight", type=float, default=float(e("DECODE_WEIGHT", d.decode_weight)))
        p.add_argument("--temperature", type=float, default=float(e("TEMPERATURE", d.temperature)))
        p.add_argument("--stale-seconds", type=float, default=float(e("STALE_SECONDS", d.stale_seconds)))
        p.add_argument("--approx-ttl", type=float, default=float(e("APPROX_TTL", d.approx_ttl_seconds)))
        p.add_argument("--approx-max-blocks", type=int, default=int(e("APPROX_MAX_BLOCKS", d.approx_max_blocks)))
        p.add_argument("--seed", type=int, default=int(env["EMBEDMESH_ROUTER_SEED"])
                       if "EMBEDMESH_ROUTER_SEED" in env else None)
        a = p.parse_args(argv)
        try:
            return cls(host=a.host, port=a.port, metrics_port=a.metrics_port, prefill_weight=a.prefill_weight,
                       decode_weight=a.decode_weight, temperature=a.temperature, stale_seconds=a.stale_seconds,
                       approx_ttl_seconds=a.approx_ttl, approx_max_blocks=a.approx_max_blocks, seed=a.seed)
        except ValueError as err:
            p.error(str(err))
            raise  # unreachable: p.error exits

    def describe(self) -> dict[str, object]:
        return asdict(self)

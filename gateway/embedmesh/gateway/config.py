"""Gateway configuration: one typed dataclass. CLI flags and environment variables are read here and nowhere else.

    flag                env var                                default
    --host              EMBEDMESH_GATEWAY_HOST                 127.0.0.1
    --port              EMBEDMESH_GATEWAY_PORT                 8000
    --preprocessor      EMBEDMESH_PREPROCESSOR_ADDR            127.0.0.1:50051
    --vector-store      EMBEDMESH_VECTOR_STORE_ADDR            (none)
    --max-body-bytes    EMBEDMESH_GATEWAY_MAX_BODY_BYTES       1 GiB
    --request-timeout   EMBEDMESH_GATEWAY_REQUEST_TIMEOUT      600 s
    --metrics-require-key EMBEDMESH_GATEWAY_METRICS_REQUIRE_KEY  off (/metrics open)
    --max-inflight      EMBEDMESH_GATEWAY_MAX_INFLIGHT         512 (0 = no limit)

API keys, TLS and the mesh token are read by ``embedmesh.core.security`` (the same flags on every service).

A flag beats its env var, which beats the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["GatewayConfig"]


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway listens and where it sends requests."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 8000
    """HTTP port in [0, 65535]; 0 picks a free one."""
    preprocessor: str = "127.0.0.1:50051"
    """host:port of the public gRPC InferenceService (the preprocessor, or an Envoy in front of its replicas)."""
    vector_store: str = ""
    """host:port of the VectorStoreService; empty = none (its routes are not served)."""
    max_body_bytes: int = 1 << 30
    """Largest request body accepted, in bytes (413 above it); at least 1 KiB."""
    request_timeout_seconds: float = 600.0
    """Deadline of each completion/embedding gRPC call, in seconds (> 0); a stream must end within it."""
    metrics_require_key: bool = False
    """Whether ``/metrics`` needs an API key too (when keys are configured)."""
    max_inflight: int = 512
    """Requests in flight at once (streams until their last byte); more get 503 + Retry-After at once. 0 = no
    limit."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.preprocessor:
            raise ValueError("preprocessor address is required (host:port)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {self.max_inflight}")
        if not self.request_timeout_seconds > 0:
            raise ValueError(f"request_timeout_seconds must be > 0, got {self.request_timeout_seconds}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """Parse ``argv`` (default: ``sys.argv[1:]``) over ``env`` (default: ``os.environ``) over the defaults."""
        env = os.environ if env is None else env
        p = argparse.ArgumentParser(prog="python -m embedmesh.gateway.main",
                                    description="Run the embedmesh OpenAI-compatible REST gateway.")
        p.add_argument("--host", default=env.get("EMBEDMESH_GATEWAY_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(env.get("EMBEDMESH_GATEWAY_PORT", cls.port)))
        p.add_argument("--preprocessor", default=env.get("EMBEDMESH_PREPROCESSOR_ADDR", cls.preprocessor),
                       help="host:port of the InferenceService")
        p.add_argument("--vector-store", default=env.get("EMBEDMESH_VECTOR_STORE_ADDR", cls.vector_store))
        p.add_argument("--max-body-bytes", type=int,
                       default=int(env.get("EMBEDMESH_GATEWAY_MAX_BODY_BYTES", cls.max_body_bytes)))
        p.add_argument("--request-timeout", type=float,
                       default=float(env.get("EMBEDMESH_GATEWAY_REQUEST_TIMEOUT", cls.request_timeout_seconds)),
                       help="seconds")
        p.add_argument("--metrics-require-key", action="store_true",
                       default=env.get("EMBEDMESH_GATEWAY_METRICS_REQUIRE_KEY", "") in ("1", "true", "yes"))
        p.add_argument("--max-inflight", type=int,
                       default=int(env.get("EMBEDMESH_GATEWAY_MAX_INFLIGHT", cls.max_inflight)),
                       help="requests in flight at once; more are refused with 503 + Retry-After (0 = no limit)")
        a = p.parse_args(argv)
        try:
            return cls(host=a.host, port=a.port, preprocessor=a.preprocessor, vector_store=a.vector_store,
                       max_body_bytes=a.max_body_bytes, request_timeout_seconds=a.request_timeout,
                       metrics_require_key=a.metrics_require_key, max_inflight=a.max_inflight)
        except ValueError as e:
            p.error(str(e))

    def describe(self) -> dict[str, object]:
        """The config as a plain dict (for the start-up log)."""
        return asdict(self)

    def __str__(self) -> str:
        return "GatewayConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.describe().items()) + ")"

"""Gateway configuration: one typed dataclass; CLI flags and ``EMBEDMESH_GATEWAY_*`` env vars are read here only."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

__all__ = ["GatewayConfig"]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 8000
    """HTTP port."""
    preprocessor: str = "127.0.0.1:50051"
    """Address of the public gRPC InferenceService (the preprocessor, or an Envoy in front of replicas)."""
    vector_store: str = ""
    """Address of the VectorStoreService; empty = /v1/files and /v1/vector_stores answer 501."""
    max_body_bytes: int = 1 << 30
    """Largest request body accepted (413 above it)."""
    request_timeout_seconds: float = 600.0
    """Deadline of each gRPC call."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.request_timeout_seconds <= 0:
            raise ValueError("request_timeout_seconds must be > 0")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> GatewayConfig:
        env = os.environ
        p = argparse.ArgumentParser(prog="embedmesh-gateway", description="Run the embedmesh REST gateway.")
        p.add_argument("--host", default=env.get("EMBEDMESH_GATEWAY_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(env.get("EMBEDMESH_GATEWAY_PORT", cls.port)))
        p.add_argument("--preprocessor", default=env.get("EMBEDMESH_PREPROCESSOR_ADDR", cls.preprocessor))
        p.add_argument("--vector-store", default=env.get("EMBEDMESH_VECTOR_STORE_ADDR", cls.vector_store))
        p.add_argument("--max-body-bytes", type=int,
                       default=int(env.get("EMBEDMESH_GATEWAY_MAX_BODY_BYTES", cls.max_body_bytes)))
        p.add_argument("--request-timeout", type=float,
                       default=float(env.get("EMBEDMESH_GATEWAY_REQUEST_TIMEOUT", cls.request_timeout_seconds)))
        a = p.parse_args(argv)
        return cls(a.host, a.port, a.preprocessor, a.vector_store, a.max_body_bytes, a.request_timeout)

    def describe(self) -> dict[str, object]:
        return asdict(self)

"""The OpenAI-compatible REST gateway: translates REST 1:1 to the mesh's public gRPC API. No business logic."""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported
from embedmesh.gateway.app import create_app
from embedmesh.gateway.config import GatewayConfig

__all__ = ["create_app", "GatewayConfig"]

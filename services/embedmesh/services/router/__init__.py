"""The KV-aware router: worker registry, radix indexer over chained block hashes, and cost-based choice.

Modules: ``indexer`` (the radix index), ``approx`` (tracking for engines without KV events), ``registry`` (live
workers, event batches, liveness), ``scoring`` (the cost model), ``policy`` (one decision), ``servicer`` (gRPC),
``config`` / ``main`` (bootstrap); client side: ``route_client`` (preprocessor); the workers' side is
``worker.router_link``.
"""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported

__all__ = ["RadixIndexer", "KvRouter", "Registry", "Weights"]

from embedmesh.services.router.indexer import RadixIndexer
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.registry import Registry
from embedmesh.services.router.scoring import Weights

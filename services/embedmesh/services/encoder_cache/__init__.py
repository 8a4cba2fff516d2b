"""The encoder cache: content-addressed tensors in process (L1, bytes-bounded LRU) over Redis (L2, shared)."""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported
from embedmesh.services.encoder_cache.keys import content_key, payload_key
from embedmesh.services.encoder_cache.lru import ByteLRU
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache

__all__ = ["ByteLRU", "CachedTensor", "TieredCache", "content_key", "payload_key"]

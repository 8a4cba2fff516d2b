"""A worker: one engine instance behind ``embedmesh.worker.v1.WorkerService``."""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported

"""The preprocessor: the mesh's public gRPC entry (``embedmesh.inference.v1.InferenceService``)."""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported

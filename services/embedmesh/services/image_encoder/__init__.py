"""The image encode service: decoded pixels -> embedding rows for a served model (``ImageEncoderService``)."""

import embedmesh.core.grpc_runtime  # noqa: F401 - first: gRPC reads its settings when it is imported

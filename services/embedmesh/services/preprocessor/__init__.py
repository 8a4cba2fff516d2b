"""The preprocessor: the mesh's public gRPC entry (``embedmesh.inference.v1.InferenceService``)."""

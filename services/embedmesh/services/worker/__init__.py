"""A worker: one engine instance behind ``embedmesh.worker.v1.WorkerService``."""

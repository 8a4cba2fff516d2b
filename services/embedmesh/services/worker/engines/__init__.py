"""Engines behind a worker: one module per engine, each implementing ``base.Engine``."""

from embedmesh.services.worker.engines.base import Engine

__all__ = ["Engine"]

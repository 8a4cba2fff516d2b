"""The echo engine's options (see ``engines/options.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.services.worker.engines import options

__all__ = ["EchoOptions"]


@dataclass(frozen=True)
class EchoOptions(options.EngineOptions):
    hidden_size: int = 576
    """Hidden size the echo engine claims (the width prompt embeddings must have)."""

"""The hf-embed engine's options (see ``engines/options.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.services.worker.engines import options

__all__ = ["HFEmbedOptions"]


@dataclass(frozen=True)
class HFEmbedOptions(options.EngineOptions):
    threads: int = options.threads()

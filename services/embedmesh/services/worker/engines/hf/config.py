"""The hf engine's options: flags and ``EMBEDMESH_WORKER_*`` variables (see ``engines/options.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.services.worker.engines import options

__all__ = ["HFOptions"]


@dataclass(frozen=True)
class HFOptions(options.EngineOptions):
    max_batch_size: int = options.max_batch_size()
    threads: int = options.threads()
    dtype: str = options.dtype()

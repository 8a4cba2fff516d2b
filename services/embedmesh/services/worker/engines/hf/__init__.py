"""The ``hf`` engine: a transformers causal LM on the CPU with continuous batching (``engine.py``), per-row logits
processors (``logits.py``), incremental detokenization (``detok.py``), its options (``config.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.hf.config import HFOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.config import WorkerConfig
    from embedmesh.services.worker.engines.base import Engine

__all__ = ["HFOptions", "build"]


def build(config: WorkerConfig) -> Engine:
    from embedmesh.models.convert import DEFAULT_MODEL, resolve_model_path
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    o = config.options_as(HFOptions)
    path = resolve_model_path(config.model)
    return HFEngine(HFEngineConfig(path, config.name_to_serve(path.name, DEFAULT_MODEL), o.max_batch_size,
                                   o.threads, o.dtype))

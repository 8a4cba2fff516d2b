"""The ``hf`` engine: a transformers causal LM on the CPU with continuous batching (``engine.py``: the engine thread's
loop; ``scheduler.py``, ``runner.py``, ``sampler.py``, ``lora.py`` and ``sequence.py`` its parts), per-row logits
processors (``logits.py``), incremental detokenization (``detok.py``), the prefix cache (``prefix_cache.py``,
``kv_blocks.py``), its options (``config.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.hf.config import HFOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.engines.base import Engine, EngineContext

__all__ = ["HFOptions", "build"]


def build(context: EngineContext) -> Engine:
    from embedmesh.models.convert import DEFAULT_MODEL, resolve_model_path
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    o = context.options_as(HFOptions)
    path = resolve_model_path(context.model)
    return HFEngine(HFEngineConfig(path, context.name_to_serve(path.name, DEFAULT_MODEL), o.max_batch_size,
                                   o.threads, o.dtype, o.hf_device, context.block_size,
                                   o.hf_prefix_cache_blocks))

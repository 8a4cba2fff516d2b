"""The ``vllm`` engine: vLLM's AsyncLLM (``engine.py``), its KV events in the mesh's hashes (``kv_events.py``), its
scheduler metrics (``metrics.py``) and options (``config.py``). Runs in vLLM's own venv."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.vllm.config import VLLMOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.engines.base import Engine, EngineContext

__all__ = ["VLLMOptions", "build"]


def build(context: EngineContext) -> Engine:
    """KV events are published only to routers (``--routers``); ``--kv-events-log`` also writes them to a file."""
    from embedmesh.models.convert import DEFAULT_MODEL, resolve_model_path
    from embedmesh.services.worker.engines.vllm.engine import VLLMConfig, VLLMEngine
    from embedmesh.services.worker.engines.vllm.kv_events import events_log

    o = context.options_as(VLLMOptions)
    path = resolve_model_path(context.model)
    engine = VLLMEngine(VLLMConfig(path, context.name_to_serve(path.name, DEFAULT_MODEL), dtype=o.dtype,
                                   max_model_len=o.max_model_len, gpu_memory_utilization=o.gpu_memory_utilization,
                                   tensor_parallel_size=o.tensor_parallel_size, max_num_seqs=o.max_batch_size,
                                   enable_lora=context.enable_lora, block_size=o.vllm_block_size or None,
                                   kv_cache_memory_bytes=o.kv_cache_memory_bytes or None,
                                   kv_events=o.kv_events and bool(context.routers),
                                   kv_event_block_size=context.block_size, ready_timeout_seconds=o.ready_timeout,
                                   enable_sleep_mode=o.enable_sleep_mode))
    if o.kv_events_log and engine.kv_event_source() is not None:
        engine.on_kv_events(events_log(o.kv_events_log))
    return engine

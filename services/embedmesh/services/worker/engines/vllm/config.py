"""The vllm engine's options: flags and ``EMBEDMESH_WORKER_*`` variables, the older ``EMBEDMESH_VLLM_*`` names kept
(see ``engines/options.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.core.config import option
from embedmesh.services.worker.engines import options

__all__ = ["VLLMOptions"]


@dataclass(frozen=True)
class VLLMOptions(options.EngineOptions):
    dtype: str = options.dtype()
    max_batch_size: int = options.max_batch_size()
    max_model_len: int = option(4096, aliases=("EMBEDMESH_VLLM_MAX_MODEL_LEN",))
    """Context length vLLM reserves KV cache for."""
    gpu_memory_utilization: float = option(0.9, aliases=("EMBEDMESH_VLLM_GPU_MEMORY_UTILIZATION",))
    """Fraction of GPU memory for weights and KV cache (GPU only)."""
    tensor_parallel_size: int = option(1, aliases=("EMBEDMESH_VLLM_TP",))
    """GPUs per worker (GPU only)."""
    enable_sleep_mode: bool = option(False, aliases=("EMBEDMESH_VLLM_ENABLE_SLEEP_MODE",))
    """vLLM's sleep mode (GPUs: CUDA's memory pool), so Sleep releases memory."""
    vllm_block_size: int = option(0, aliases=("EMBEDMESH_VLLM_BLOCK_SIZE",))
    """vLLM's KV block size in positions (0 = vLLM's default: 16 on GPUs, 128 on CPUs)."""
    kv_cache_memory_bytes: int = option(0, aliases=("EMBEDMESH_VLLM_KV_CACHE_MEMORY_BYTES",))
    """KV cache size (0 = vLLM sizes it: --gpu-memory-utilization on GPUs, VLLM_CPU_KVCACHE_SPACE GiB on CPUs)."""
    ready_timeout: float = option(300.0, aliases=("EMBEDMESH_VLLM_READY_TIMEOUT",))
    """Seconds a request that arrives while the engine loads waits for it before failing UNAVAILABLE."""
    kv_events: bool = option(True, aliases=("EMBEDMESH_VLLM_KV_EVENTS",))
    """Publish vLLM's KV events to the routers (with --routers); --no-kv-events: tracked approximately."""
    kv_events_log: str = option("", aliases=("EMBEDMESH_VLLM_KV_EVENTS_LOG",))
    """Also append every KV event sent to the routers to this file, one JSON line each (debugging)."""

    def validate(self) -> None:
        if self.vllm_block_size < 0 or self.kv_cache_memory_bytes < 0:
            raise ValueError("vllm_block_size and kv_cache_memory_bytes must be >= 0 (0 = vLLM's default)")
        if self.ready_timeout <= 0:
            raise ValueError("ready_timeout must be > 0 seconds")

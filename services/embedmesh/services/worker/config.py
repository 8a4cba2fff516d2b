"""Worker configuration: one typed dataclass, read from CLI flags and ``EMBEDMESH_WORKER_*`` env vars in one place."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

from embedmesh.services.worker.engines import registry

__all__ = ["WorkerConfig", "ENGINES"]

ENGINES = registry.names()
"""Engine names, from the registry (``engines/registry.py``)."""


@dataclass(frozen=True)
class WorkerConfig:
    engine: str = "hf"
    """Engine kind: "hf" (transformers generation, the default), "hf-embed" (sentence-transformers embeddings)
    or "echo" (no model; for overhead benchmarks)."""
    model: str = "default"
    """Local Hugging Face folder, or "default" for the bundled SmolLM2-135M-Instruct."""
    served_name: str = ""
    """Name clients use; defaults to the default model's name or the folder's name."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50061
    """gRPC port (0 = any free port)."""
    max_batch_size: int = 8
    """Most sequences decoded together (hf)."""
    max_queue: int = 64
    """Sequences allowed to wait beyond a full batch; past them Generate is refused at once (RESOURCE_EXHAUSTED,
    WORKER_BUSY, with a retry delay) instead of queueing without bound."""
    threads: int = 2
    """torch threads (hf)."""
    watchdog_seconds: float = 120.0
    """An engine with work queued and no progress for this long makes the worker report NOT_SERVING, fail its
    queued requests (UNAVAILABLE, retryable) and exit for its supervisor to restart it; 0 = no stall check (an
    engine whose thread died is acted on regardless)."""
    dtype: str = "float32"
    """Compute dtype for hf: float32, bfloat16 or float16."""
    hidden_size: int = 576
    """Hidden size the echo engine claims."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    routers: tuple[str, ...] = ()
    """KV router addresses to register with (empty = not routable by KV overlap)."""
    advertise: str = ""
    """Address the router hands out for this worker (default host:port)."""
    block_size: int = 16
    """Positions per KV block for routing hashes; must match the preprocessor's."""
    max_model_len: int = 4096
    """vllm worker: context length vLLM reserves KV cache for."""
    gpu_memory_utilization: float = 0.9
    """vllm worker: fraction of GPU memory for weights and KV cache (GPU only)."""
    tensor_parallel_size: int = 1
    """vllm worker: GPUs per worker (GPU only)."""
    enable_lora: bool = False
    """vllm and sglang (generate) workers: allow LoRA adapters (LoadLoraAdapter); hf always allows them."""
    lora_root: str = ""
    """Folder LoRA adapters load from (resolved; nothing outside it); empty = $EMBEDMESH_CACHE/lora-adapters."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters loaded at start, before the worker serves: (name, folder under the LoRA root) pairs, given as
    ``--lora-modules name=path ...`` (vLLM's flag)."""
    enable_sleep_mode: bool = False
    """vllm worker: create the engine with vLLM's sleep mode, so Sleep releases memory (GPUs only)."""
    vllm_block_size: int = 0
    """vllm worker: vLLM's KV block size in positions (0 = vLLM's default: 16 on GPUs, 128 on CPUs)."""
    kv_cache_memory_bytes: int = 0
    """vllm worker: KV cache size (0 = vLLM sizes it: --gpu-memory-utilization on GPUs, VLLM_CPU_KVCACHE_SPACE GiB
    on CPUs)."""
    ready_timeout: float = 300.0
    """vllm worker: seconds a request arriving while the engine loads waits before failing UNAVAILABLE."""
    kv_events: bool = True
    """vllm worker: publish vLLM's KV events to the routers (with --routers); off = tracked approximately."""
    kv_events_log: str = ""
    """vllm worker: also append every KV event sent to the routers to this file, one JSON line each (debugging)."""
    sglang_task: str = "embed"
    """sglang worker: "embed" (CPU or GPU) or "generate" (GPU only)."""
    sglang_device: str = "cpu"
    """sglang worker: SGLang device ("cpu", "cuda")."""
    sglang_max_total_tokens: int = 8192
    """sglang worker: size of SGLang's token pool."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            registry.spec(self.engine)  # raises UnknownEngine (a ValueError) listing the known engines
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if not self.watchdog_seconds >= 0:  # also refuses NaN
            raise ValueError(f"watchdog_seconds must be >= 0 (0 = off), got {self.watchdog_seconds}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.vllm_block_size < 0 or self.kv_cache_memory_bytes < 0:
            raise ValueError("vllm_block_size and kv_cache_memory_bytes must be >= 0 (0 = vLLM's default)")
        if self.ready_timeout <= 0:
            raise ValueError("ready_timeout must be > 0 seconds")
        if self.sglang_task not in ("embed", "generate") or self.sglang_max_total_tokens < 1:
            raise ValueError("sglang_task must be 'embed' or 'generate' and sglang_max_total_tokens >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> WorkerConfig:
        env = os.environ
        p = argparse.ArgumentParser(prog="embedmesh-worker", description="Run one embedmesh worker.")
        p.add_argument("--engine", default=env.get("EMBEDMESH_WORKER_ENGINE", cls.engine),
                       help="; ".join(f"{s.name}: {s.summary}" for s in map(registry.spec, ENGINES)))
        p.add_argument("--model", default=env.get("EMBEDMESH_WORKER_MODEL", cls.model))
        p.add_argument("--served-name", default=env.get("EMBEDMESH_WORKER_SERVED_NAME", cls.served_name))
        p.add_argument("--host", default=env.get("EMBEDMESH_WORKER_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(env.get("EMBEDMESH_WORKER_PORT", cls.port)))
        p.add_argument("--max-batch-size", type=int,
                       default=int(env.get("EMBEDMESH_WORKER_MAX_BATCH_SIZE", cls.max_batch_size)))
        p.add_argument("--max-queue", type=int, default=int(env.get("EMBEDMESH_WORKER_MAX_QUEUE", cls.max_queue)),
                       help="sequences that may wait beyond a full batch before Generate is refused")
        p.add_argument("--threads", type=int, default=int(env.get("EMBEDMESH_WORKER_THREADS", cls.threads)))
        p.add_argument("--watchdog-seconds", type=float,
                       default=float(env.get("EMBEDMESH_WORKER_WATCHDOG_SECONDS", cls.watchdog_seconds)),
                       help="exit (for the supervisor to restart) when the engine makes no progress this long with "
                            "work queued; 0 = off")
        p.add_argument("--dtype", default=env.get("EMBEDMESH_WORKER_DTYPE", cls.dtype))
        p.add_argument("--hidden-size", type=int, default=cls.hidden_size)
        p.add_argument("--metrics-port", type=int, default=int(env.get("EMBEDMESH_WORKER_METRICS_PORT", 0)))
        p.add_argument("--routers", default=env.get("EMBEDMESH_ROUTERS", ""), help="comma-separated addresses")
        p.add_argument("--advertise", default=env.get("EMBEDMESH_WORKER_ADVERTISE", ""))
        p.add_argument("--block-size", type=int, default=int(env.get("EMBEDMESH_BLOCK_SIZE", cls.block_size)))
        p.add_argument("--max-model-len", type=int, default=int(env.get("EMBEDMESH_VLLM_MAX_MODEL_LEN", 4096)))
        p.add_argument("--gpu-memory-utilization", type=float,
                       default=float(env.get("EMBEDMESH_VLLM_GPU_MEMORY_UTILIZATION", 0.9)))
        p.add_argument("--tensor-parallel-size", type=int, default=int(env.get("EMBEDMESH_VLLM_TP", 1)))
        p.add_argument("--enable-lora", action="store_true", default=env.get("EMBEDMESH_VLLM_ENABLE_LORA") == "1",
                       help="vllm and sglang (generate) workers: allow LoRA adapters (the hf engine always does)")
        p.add_argument("--lora-root", default=env.get("EMBEDMESH_LORA_ROOT", ""),
                       help="adapters load only from folders under this one")
        p.add_argument("--lora-modules", nargs="*", default=env.get("EMBEDMESH_LORA_MODULES", "").split(),
                       metavar="NAME=PATH", help="LoRA adapters to load before serving (folders under --lora-root)")
        p.add_argument("--enable-sleep-mode", action="store_true",
                       default=env.get("EMBEDMESH_VLLM_ENABLE_SLEEP_MODE") == "1",
                       help="vllm worker: vLLM's sleep mode (GPUs), so Sleep releases memory")
        p.add_argument("--vllm-block-size", type=int, default=int(env.get("EMBEDMESH_VLLM_BLOCK_SIZE", 0)))
        p.add_argument("--kv-cache-memory-bytes", type=int,
                       default=int(env.get("EMBEDMESH_VLLM_KV_CACHE_MEMORY_BYTES", 0)))
        p.add_argument("--ready-timeout", type=float,
                       default=float(env.get("EMBEDMESH_VLLM_READY_TIMEOUT", cls.ready_timeout)),
                       help="seconds a request that arrives while the engine loads waits for it")
        p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                       default=env.get("EMBEDMESH_VLLM_KV_EVENTS", "1") != "0")
        p.add_argument("--kv-events-log", default=env.get("EMBEDMESH_VLLM_KV_EVENTS_LOG", ""),
                       help="append every KV event sent to the routers to this file as JSON lines")
        p.add_argument("--sglang-task", default=env.get("EMBEDMESH_SGLANG_TASK", cls.sglang_task))
        p.add_argument("--sglang-device", default=env.get("EMBEDMESH_SGLANG_DEVICE", cls.sglang_device))
        p.add_argument("--sglang-max-total-tokens", type=int,
                       default=int(env.get("EMBEDMESH_SGLANG_MAX_TOTAL_TOKENS", cls.sglang_max_total_tokens)))
        a = p.parse_args(argv)
        values = vars(a)
        values["routers"] = tuple(r.strip() for r in a.routers.split(",") if r.strip())
        modules = []
        for item in a.lora_modules or ():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                p.error(f"--lora-modules: {item!r} is not NAME=PATH")
            modules.append((name, path))
        values["lora_modules"] = tuple(modules)
        try:
            return cls(**values)
        except ValueError as e:  # a bad value: argparse's usage + message, exit status 2, no traceback
            p.error(str(e))

    def describe(self) -> dict[str, object]:
        return asdict(self)

"""The one list of worker engines: name -> how to build it from the worker's config, which venv it runs in, and
what it serves. ``worker/main.py`` builds engines only through ``build_engine``; the worker's config checks
``--engine`` against ``names()``; the launcher asks ``venv_of`` which interpreter a worker needs.

Adding an engine = a module under ``worker/engines/`` with an ``Engine`` subclass, plus one ``register`` call
below (see docs/ARCHITECTURE.md). Factories import their engine lazily: a worker loads only the libraries of the
engine it runs (torch for hf, vllm in its own venv, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from embedmesh.services.worker.config import WorkerConfig
    from embedmesh.services.worker.engines.base import Engine

__all__ = ["EngineSpec", "register", "names", "spec", "build_engine", "venv_of", "UnknownEngine"]


class UnknownEngine(ValueError):
    """An engine name nobody registered; the message lists the known ones."""


@dataclass(frozen=True)
class EngineSpec:
    name: str
    build: Callable[[WorkerConfig], Engine]
    """Engine from the worker's config (imports the engine module lazily)."""
    summary: str
    """One line for --help and the README."""
    venv: str | None = None
    """Launcher flag naming the venv the engine runs in (``--vllm-venv``), or None: this checkout's venv."""
    tasks: tuple[str, ...] = ("generate",)
    """What it can serve: "generate", "embed"."""
    venv_env: tuple[tuple[str, str], ...] = ()
    """Environment defaults the launcher sets for a worker in that venv (the caller's environment wins)."""


_REGISTRY: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"engine {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def spec(name: str) -> EngineSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(_REGISTRY)
        raise UnknownEngine(f"unknown engine {name!r}; known engines: {known}") from None


def build_engine(config: WorkerConfig) -> Engine:
    return spec(config.engine).build(config)


def venv_of(name: str) -> str | None:
    return spec(name).venv


# --- the engines ---------------------------------------------------------------------------------------------


def _served(config: WorkerConfig, path_name: str, default: str) -> str:
    return config.served_name or (default if config.model in ("default", default) else path_name)


def _hf(config: WorkerConfig) -> Engine:
    from embedmesh.models.convert import DEFAULT_MODEL, resolve_model_path
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    path = resolve_model_path(config.model)
    return HFEngine(HFEngineConfig(path, _served(config, path.name, DEFAULT_MODEL), config.max_batch_size,
                                   config.threads, config.dtype))


def _hf_embed(config: WorkerConfig) -> Engine:
    from pathlib import Path

    from embedmesh.models.minilm import DEFAULT_EMBEDDING_MODEL, minilm_dir
    from embedmesh.services.worker.engines.hf_embed.engine import HFEmbedConfig, HFEmbedEngine

    default = config.model in ("default", DEFAULT_EMBEDDING_MODEL)
    folder = minilm_dir() if default else Path(config.model)
    return HFEmbedEngine(HFEmbedConfig(folder, _served(config, folder.name, DEFAULT_EMBEDDING_MODEL),
                                       threads=config.threads))


def _vllm(config: WorkerConfig) -> Engine:
    from embedmesh.models.convert import DEFAULT_MODEL, resolve_model_path
    from embedmesh.services.worker.engines.vllm.engine import VLLMConfig, VLLMEngine

    path = resolve_model_path(config.model)
    return VLLMEngine(VLLMConfig(path, _served(config, path.name, DEFAULT_MODEL), dtype=config.dtype,
                                 max_model_len=config.max_model_len,
                                 gpu_memory_utilization=config.gpu_memory_utilization,
                                 tensor_parallel_size=config.tensor_parallel_size,
                                 max_num_seqs=config.max_batch_size, enable_lora=config.enable_lora,
                                 block_size=config.vllm_block_size or None,
                                 kv_cache_memory_bytes=config.kv_cache_memory_bytes or None,
                                 kv_events=config.kv_events and bool(config.routers),
                                 kv_event_block_size=config.block_size,
                                 ready_timeout_seconds=config.ready_timeout,
                                 enable_sleep_mode=config.enable_sleep_mode))


def _sglang(config: WorkerConfig) -> Engine:
    from embedmesh.services.worker.engines.sglang.engine import from_worker_config

    return from_worker_config(config)


def _echo(config: WorkerConfig) -> Engine:
    from embedmesh.services.worker.engines.echo.engine import EchoEngine

    return EchoEngine(config.served_name or "echo", hidden_size=config.hidden_size)


register(EngineSpec("hf", _hf, "transformers causal LM on the CPU with continuous batching (the default)"))
register(EngineSpec("hf-embed", _hf_embed, "sentence-transformers embedding model (/v1/embeddings)",
                    tasks=("embed",)))
register(EngineSpec("vllm", _vllm, "vLLM's AsyncLLM (CPU build here; GPU in production)", venv="--vllm-venv",
                    venv_env=(("VLLM_CPU_KVCACHE_SPACE", "1"),)))
register(EngineSpec("sglang", _sglang, "SGLang's Engine (embeddings on CPU; generation on GPU)",
                    venv="--sglang-venv", tasks=("embed", "generate")))
register(EngineSpec("echo", _echo, "no model: echoes the prompt (overhead benchmarks)"))

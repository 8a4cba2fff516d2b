"""The one list of worker engines: name -> how to build it from the worker's config, which venv it runs in, and
what it serves. ``worker/main.py`` builds engines only through ``build_engine``; the worker's config checks
``--engine`` against ``names()``; the launcher asks ``venv_of`` which interpreter a worker needs.

Adding an engine = one folder under ``worker/engines/`` (its ``Engine`` subclass, its options dataclass in
``config.py``, a ``build`` factory in ``__init__.py``) plus one ``register`` line below (see docs/ARCHITECTURE.md).
An engine's ``build`` takes an ``EngineContext`` (``engines/base.py``: model, served name, routers, block size, LoRA
settings and its own options), never the worker's config. Importing a folder loads only its options; ``build``
imports the engine lazily, so a worker loads only the libraries of the engine it runs (torch for hf, vllm in its
own venv, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from embedmesh.services.worker.engines import echo, hf, hf_embed, mocker, sglang, vllm

if TYPE_CHECKING:
    from embedmesh.services.worker.config import WorkerConfig
    from embedmesh.services.worker.engines.base import Engine, EngineContext
    from embedmesh.services.worker.engines.options import EngineOptions

__all__ = ["EngineSpec", "register", "names", "spec", "build_engine", "engine_context", "venv_of", "UnknownEngine"]


class UnknownEngine(ValueError):
    """An engine name nobody registered; the message lists the known ones."""


@dataclass(frozen=True)
class EngineSpec:
    name: str
    build: Callable[[EngineContext], Engine]
    """Engine from its context (imports the engine module lazily); its own options are
    ``context.options_as(<options class>)``."""
    summary: str
    """One line for --help and the README."""
    options: type[EngineOptions] | None = None
    """The engine's options dataclass (``<folder>/config.py``): its fields become worker flags."""
    venv: str | None = None
    """Launcher flag naming the venv the engine runs in (``--vllm-venv``), or None: this checkout's venv."""
    tasks: tuple[str, ...] = ("generate",)
    """What it can serve: "generate", "embed"."""
    lora_needs_flag: bool = False
    """LoRA adapters only with ``--enable-lora`` (the engine reserves adapter slots at start); the launcher passes
    it when adapters are asked for."""
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
    """The configured engine, built from ``engine_context(config)``."""
    return spec(config.engine).build(engine_context(config))


def engine_context(config: WorkerConfig) -> EngineContext:
    """What an engine is built from: the worker's settings engines read, and the configured engine's options."""
    from embedmesh.services.worker.engines.base import EngineContext

    return EngineContext(engine=config.engine, model=config.model, served_name=config.served_name,
                         routers=config.routers, block_size=config.block_size, enable_lora=config.enable_lora,
                         lora_modules=config.lora_modules, options=config.engine_options)


def venv_of(name: str) -> str | None:
    return spec(name).venv


# --- the engines ---------------------------------------------------------------------------------------------

register(EngineSpec("hf", hf.build, "transformers causal LM on the CPU with continuous batching (the default)",
                    options=hf.HFOptions))
register(EngineSpec("hf-embed", hf_embed.build, "sentence-transformers embedding model (/v1/embeddings)",
                    options=hf_embed.HFEmbedOptions, tasks=("embed",)))
register(EngineSpec("vllm", vllm.build, "vLLM's AsyncLLM (CPU build here; GPU in production)",
                    options=vllm.VLLMOptions, venv="--vllm-venv", venv_env=(("VLLM_CPU_KVCACHE_SPACE", "1"),),
                    lora_needs_flag=True))
register(EngineSpec("sglang", sglang.build, "SGLang's Engine (embeddings on CPU; generation on GPU)",
                    options=sglang.SGLangOptions, venv="--sglang-venv", tasks=("embed", "generate"),
                    lora_needs_flag=True))
register(EngineSpec("echo", echo.build, "no model: echoes the prompt (overhead benchmarks)",
                    options=echo.EchoOptions))
register(EngineSpec("mocker", mocker.build, "no model: simulated paged KV cache and timing (router and fleet tests)",
                    options=mocker.MockerOptions))

"""Worker configuration: one typed dataclass (``core.config.Settings``); flags and ``EMBEDMESH_WORKER_*`` variables
(the older names kept as aliases) are read here only.

The worker's own settings are fields here; each engine's knobs are declared in its folder
(``engines/<name>/config.py``, referenced by its ``EngineSpec``) and composed in: every registered engine's flags
are accepted and checked (one ``--help`` group per engine), and the configured engine's options dataclass is
``engine_options``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar

from embedmesh.core.config import OptionInfo, Settings, option, read_values
from embedmesh.services.worker.engines import options as engine_options
from embedmesh.services.worker.engines import registry

__all__ = ["WorkerConfig"]

_O = TypeVar("_O")


@dataclass(frozen=True)
class WorkerConfig(Settings, service="worker", prog="embedmesh-worker", description="Run one embedmesh worker."):
    engine: str = "hf"
    """The engine to serve, a name registered in engines/registry.py (see the engine groups below)."""
    model: str = "default"
    """Local Hugging Face folder, or "default" for the engine's bundled model (SmolLM2-135M-Instruct;
    all-MiniLM-L6-v2 for embedding engines)."""
    served_name: str = ""
    """Name clients use; defaults to the default model's name or the folder's name."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50061
    """gRPC port (0 = any free port)."""
    max_queue: int = 64
    """Sequences allowed to wait beyond a full batch; past them Generate is refused at once (RESOURCE_EXHAUSTED,
    WORKER_BUSY, with a retry delay) instead of queueing without bound."""
    watchdog_seconds: float = 120.0
    """An engine with work queued and no progress for this long makes the worker report NOT_SERVING, fail its
    queued requests (UNAVAILABLE, retryable) and exit for its supervisor to restart it; 0 = no stall check (an
    engine whose thread died is acted on regardless)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    routers: tuple[str, ...] = option((), aliases=("EMBEDMESH_ROUTERS",), metavar="host:port")
    """KV router addresses to register with, comma-separated (empty = not routable by KV overlap)."""
    advertise: str = ""
    """Address the router hands out for this worker (default host:port)."""
    block_size: int = option(16, aliases=("EMBEDMESH_BLOCK_SIZE",))
    """Positions per KV block for routing hashes; must match the preprocessor's."""
    enable_lora: bool = option(False, aliases=("EMBEDMESH_VLLM_ENABLE_LORA",))
    """vllm and sglang (generate) workers: allow LoRA adapters (LoadLoraAdapter); hf always allows them."""
    lora_root: str = option("", aliases=("EMBEDMESH_LORA_ROOT",))
    """Folder LoRA adapters load from (resolved; nothing outside it); empty = $EMBEDMESH_CACHE/lora-adapters."""
    lora_modules: tuple[tuple[str, str], ...] = option((), aliases=("EMBEDMESH_LORA_MODULES",), nargs="*",
                                                       metavar="NAME=PATH")
    """LoRA adapters loaded at start, before the worker serves: name=folder (under the LoRA root) pairs, given as
    ``--lora-modules name=path ...`` (vLLM's flag)."""
    with_options: InitVar[Any] = None
    """The engine's options to use (an instance of its spec's options class); None = that class's defaults."""
    engine_options: Any = field(default=None, init=False)
    """The configured engine's options (an instance of its spec's ``options`` class, ``engines/<name>/config.py``)."""

    def __post_init__(self, with_options: Any) -> None:
        spec = registry.spec(self.engine)  # raises UnknownEngine (a ValueError) listing the known engines
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if not self.watchdog_seconds >= 0:  # also refuses NaN
            raise ValueError(f"watchdog_seconds must be >= 0 (0 = off), got {self.watchdog_seconds}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if with_options is None and spec.options is not None:
            with_options = spec.options()
        elif spec.options is not None and not isinstance(with_options, spec.options):
            raise ValueError(f"the options of the {self.engine} engine must be {spec.options.__name__}, got "
                             f"{type(with_options).__name__}")
        object.__setattr__(self, "engine_options", with_options)

    def options_as(self, cls: type[_O]) -> _O:
        """The configured engine's options, as the class its factory expects."""
        if not isinstance(self.engine_options, cls):
            raise TypeError(f"the {self.engine} engine's options are {type(self.engine_options).__name__}, "
                            f"not {cls.__name__}")
        return self.engine_options

    def name_to_serve(self, folder_name: str, default_model: str) -> str:
        """--served-name, else the default model's name for --model default (or that name), else the folder's."""
        return self.served_name or (default_model if self.model in ("default", default_model) else folder_name)

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The worker's own flags, then one group per registered engine with the options it declares."""
        p = super().parser()
        p.description = "Run one embedmesh worker. Engines (--engine):\n" + "\n".join(
            f"  {n}: {registry.spec(n).summary}" for n in registry.names())
        engine_options.add_arguments(p, _engine_groups())
        return p

    @classmethod
    def options(cls) -> list[OptionInfo]:
        """Every flag for documentation: the worker's own, then each engine's (a shared one once)."""
        out = list(super().options())
        seen = {o.field for o in out}
        for _, options_cls in _engine_groups():
            for o in options_cls.options():
                if o.field not in seen:
                    seen.add(o.field)
                    out.append(o)
        return out

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerConfig:
        """Flags over ``EMBEDMESH_*`` variables over defaults; a bad value, the worker's or any engine's, is
        argparse's usage error naming it (exit status 2)."""
        env = os.environ if env is None else env
        p = cls.parser()
        ns = p.parse_args(None if argv is None else list(argv))
        values = read_values(cls, ns, env, p)
        try:
            built = {name: engine_options.from_values(options_cls, ns, env, p)
                     for name, options_cls in _engine_groups()}
            return cls(**values, with_options=built.get(values.get("engine", cls.engine)))
        except ValueError as e:  # a bad value: argparse's usage + message, exit status 2, no traceback
            p.error(str(e))


def _engine_groups() -> list[tuple[str, type[engine_options.EngineOptions]]]:
    return [(n, s.options) for n, s in ((n, registry.spec(n)) for n in registry.names()) if s.options is not None]

"""Engine options: the knobs one engine reads, declared in its folder's ``config.py`` as a frozen dataclass
subclassing ``EngineOptions`` (a ``core.config.Settings`` of the worker: each field is ``--field-name`` and
``EMBEDMESH_WORKER_<FIELD>``, older variable names kept as ``aliases``, help from the field's docstring).

The worker's config (``worker/config.py``) adds every registered engine's fields to its parser, one argument group
per engine, and builds each engine's dataclass from the parsed values (so a bad value is refused whichever engine
runs, as argparse's usage error naming it); the configured engine's instance is ``WorkerConfig.engine_options`` and
its factory reads it. A field that several engines read (``dtype``, ``threads``, ``max_batch_size``) is declared
by each of them with the one definition below: it is one flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from embedmesh.core import config as core_config
from embedmesh.core.config import Settings, option

__all__ = ["EngineOptions", "add_arguments", "from_values", "dtype", "threads", "max_batch_size"]


@dataclass(frozen=True)
class EngineOptions(Settings, service="worker"):
    """Base of every engine's options dataclass: the shared fields' rules run on construction, then ``validate``
    (the engine's own rules; raise ValueError naming the setting)."""

    def __post_init__(self) -> None:
        dtype_ = getattr(self, "dtype", "float32")
        if dtype_ not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype_!r}")
        for name in ("max_batch_size", "threads"):
            if getattr(self, name, 1) < 1:
                raise ValueError(f"{name} must be >= 1")
        self.validate()

    def validate(self) -> None:
        """Rules of the engine's own fields."""


class _Once:
    """An argument group that adds each destination once (a field shared by several engines is one flag)."""

    def __init__(self, group: argparse._ArgumentGroup, seen: set[str]) -> None:
        self.group = group
        self.seen = seen

    def add_argument(self, *flags: str, **kw: Any) -> None:
        if kw["dest"] not in self.seen:
            self.seen.add(kw["dest"])
            self.group.add_argument(*flags, **kw)


def add_arguments(parser: argparse.ArgumentParser, groups: Iterable[tuple[str, type[EngineOptions]]]) -> None:
    """One argument group per (engine name, options class). A field several classes declare must be declared
    alike (same flags, variables, default and help): it is added once, with the first class's group."""
    groups = list(groups)
    seen_info: dict[str, tuple[str, core_config.OptionInfo]] = {}
    for name, cls in groups:
        for info in cls.options():
            first = seen_info.setdefault(info.field, (name, info))
            if first[1] != info:
                raise ValueError(f"engine option {info.field!r} is declared differently by {first[0]} and {name}")
    seen: set[str] = set()
    for name, cls in groups:
        core_config.add_arguments(_Once(parser.add_argument_group(f"{name} engine"), seen), cls)  # type: ignore[arg-type]


def from_values(cls: type[EngineOptions], ns: argparse.Namespace, env: Mapping[str, str],
                parser: argparse.ArgumentParser) -> EngineOptions:
    """``cls`` from the parsed flags, else its variables, else its defaults; raises ValueError for a bad value."""
    return cls(**core_config.read_values(cls, ns, env, parser))


# --- options several engines read: declare them with these, so that they are one flag ---------------------------

DTYPES = ("float32", "bfloat16", "float16")


def dtype() -> Any:
    return option("float32", help="Compute dtype: float32, bfloat16 or float16 (hf, vllm, sglang)")


def threads() -> Any:
    return option(2, help="torch threads (hf, hf-embed)")


def max_batch_size() -> Any:
    return option(8, help="Most sequences decoded together (hf; vllm's max_num_seqs; sglang generation)")

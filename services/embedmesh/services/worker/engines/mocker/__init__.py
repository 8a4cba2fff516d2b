"""The ``mocker`` engine: no model, a simulated paged KV cache and timing (``engine.py``, ``kv_cache.py``,
``timing.py``), its options (``config.py``). For fleets of workers on one machine: routing, load and failure tests
and benchmarks where a real model would be too slow."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.mocker.config import MockerOptions, check_capacity

if TYPE_CHECKING:
    from embedmesh.services.worker.engines.base import Engine, EngineContext

__all__ = ["MockerOptions", "build"]


def build(context: EngineContext) -> Engine:
    """The engine; options the cache cannot satisfy stop the worker with one line naming them (exit status 2)."""
    from embedmesh.services.worker.engines.mocker.engine import MockerEngine

    options = context.options_as(MockerOptions)
    try:
        check_capacity(options, context.block_size)
    except ValueError as e:
        print(f"embedmesh-worker: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return MockerEngine(context.served_name or "mocker", context.block_size, options)

"""The ``echo`` engine: no model, answers at once (``engine.py``), its one option (``config.py``). The smallest
example of an engine: a folder like this one and one ``register`` line in ``engines/registry.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.echo.config import EchoOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.config import WorkerConfig
    from embedmesh.services.worker.engines.base import Engine

__all__ = ["EchoOptions", "build"]


def build(config: WorkerConfig) -> Engine:
    from embedmesh.services.worker.engines.echo.engine import EchoEngine

    return EchoEngine(config.served_name or "echo", hidden_size=config.options_as(EchoOptions).hidden_size)

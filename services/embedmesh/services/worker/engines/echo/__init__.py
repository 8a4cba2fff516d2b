"""The ``echo`` engine: no model, answers at once (``engine.py``), its one option (``config.py``). The smallest
example of an engine: a folder like this one and one ``register`` line in ``engines/registry.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.echo.config import EchoOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.engines.base import Engine, EngineContext

__all__ = ["EchoOptions", "build"]


def build(context: EngineContext) -> Engine:
    from embedmesh.services.worker.engines.echo.engine import EchoEngine

    return EchoEngine(context.served_name or "echo", hidden_size=context.options_as(EchoOptions).hidden_size)

"""The echo engine's factory (``engines/echo/__init__.py: build``)."""

from __future__ import annotations

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.echo import EchoOptions, build
from embedmesh.services.worker.engines.echo.engine import EchoEngine
from embedmesh.services.worker.engines.registry import engine_context


def test_build_serves_echo_by_default_with_the_options_width() -> None:
    engine = build(engine_context(WorkerConfig(engine="echo", with_options=EchoOptions(hidden_size=32))))
    assert isinstance(engine, EchoEngine)
    assert (engine.info().model, engine.info().hidden_size) == ("echo", 32)


def test_build_uses_the_served_name() -> None:
    named = WorkerConfig.from_args(["--engine", "echo", "--served-name", "bench"])
    assert build(engine_context(named)).info().model == "bench"

"""The echo engine's one option (``engines/echo/config.py``): ``--hidden-size`` / ``EMBEDMESH_WORKER_HIDDEN_SIZE``,
576 (SmolLM2's width) by default."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.echo.config import EchoOptions


def test_default_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EchoOptions().hidden_size == 576
    assert WorkerConfig.from_args(["--engine", "echo", "--hidden-size", "8"]).options_as(EchoOptions).hidden_size == 8
    monkeypatch.setenv("EMBEDMESH_WORKER_HIDDEN_SIZE", "12")
    assert WorkerConfig.from_args(["--engine", "echo"]).options_as(EchoOptions).hidden_size == 12


def test_it_is_documented() -> None:
    (info,) = EchoOptions.options()
    assert info.field == "hidden_size" and "prompt embeddings" in info.help

"""The mocker's factory (``engines/mocker/__init__.py: build``)."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.mocker import MockerOptions, build
from embedmesh.services.worker.engines.mocker.engine import MockerEngine
from embedmesh.services.worker.engines.registry import engine_context


def test_build_serves_mocker_with_the_workers_block_size() -> None:
    engine = build(engine_context(WorkerConfig(engine="mocker", block_size=8,
                                               with_options=MockerOptions(mocker_hidden_size=32))))
    assert isinstance(engine, MockerEngine)
    assert (engine.info().model, engine.info().hidden_size, engine.block_size) == ("mocker", 32, 8)
    assert build(engine_context(WorkerConfig(engine="mocker", served_name="m"))).info().model == "m"


def test_a_cache_too_small_for_one_request_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build(engine_context(WorkerConfig(engine="mocker", with_options=MockerOptions(mocker_num_blocks=3))))
    assert e.value.code == 2
    assert "mocker_num_blocks (3)" in capsys.readouterr().err

"""The hf engine's factory (``engines/hf/__init__.py: build``): the model folder resolved (the default converted
model, or a local folder), the served name, and the options handed to ``HFEngineConfig``. Nothing is loaded until
``start``."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedmesh.models.convert import DEFAULT_MODEL, ModelNotFound, resolve_model_path
from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.hf import build
from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig
from embedmesh.services.worker.engines.registry import engine_context


def test_the_default_model_under_its_own_name() -> None:
    engine = build(engine_context(WorkerConfig.from_args([])))
    assert isinstance(engine, HFEngine)
    assert engine.config == HFEngineConfig(resolve_model_path("default"), DEFAULT_MODEL, 8, 2, "float32",
                                           block_size=16, prefix_cache_blocks=256)


def test_a_local_folder_served_under_its_name_with_the_options(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    c = build(engine_context(WorkerConfig.from_args(["--model", str(folder), "--max-batch-size", "3", "--threads",
                                                     "1", "--dtype", "bfloat16", "--block-size", "32",
                                                     "--hf-prefix-cache-blocks", "0"]))).config  # type: ignore[attr-defined]
    assert c == HFEngineConfig(folder, "my-model", 3, 1, "bfloat16", block_size=32, prefix_cache_blocks=0)
    named = build(engine_context(WorkerConfig.from_args(["--model", str(folder), "--served-name", "x"])))
    assert named.config.served_name == "x"  # type: ignore[attr-defined]


def test_a_folder_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="no config.json in that folder"):
        build(engine_context(WorkerConfig.from_args(["--model", str(tmp_path)])))

"""The hf-embed engine's factory (``engines/hf_embed/__init__.py: build``): ``--model default`` (or the default's
name) is the packaged all-MiniLM-L6-v2, another value a folder; the served name and threads reach the config."""

from __future__ import annotations

from pathlib import Path

from embedmesh.models.minilm import DEFAULT_EMBEDDING_MODEL, minilm_dir
from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.hf_embed import build
from embedmesh.services.worker.engines.hf_embed.engine import HFEmbedConfig, HFEmbedEngine
from embedmesh.services.worker.engines.registry import engine_context


def test_the_default_is_the_packaged_minilm() -> None:
    for model in ("default", DEFAULT_EMBEDDING_MODEL):
        engine = build(engine_context(WorkerConfig.from_args(["--engine", "hf-embed", "--model", model, "--threads",
                                                              "3"])))
        assert isinstance(engine, HFEmbedEngine)
        assert engine.config == HFEmbedConfig(minilm_dir(), DEFAULT_EMBEDDING_MODEL, threads=3)


def test_a_folder_served_under_its_name_or_the_served_name(tmp_path: Path) -> None:
    folder = tmp_path / "e5"
    c = build(engine_context(WorkerConfig.from_args(["--engine", "hf-embed", "--model", str(folder)]))).config  # type: ignore[attr-defined]
    assert (c.model_path, c.served_name, c.threads) == (folder, "e5", 2)
    named = build(engine_context(WorkerConfig.from_args(["--engine", "hf-embed", "--model", str(folder),
                                                         "--served-name", "x"])))
    assert named.config.served_name == "x"  # type: ignore[attr-defined]

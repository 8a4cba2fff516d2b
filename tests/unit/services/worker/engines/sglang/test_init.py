"""The sglang engine's factory (``engines/sglang/__init__.py: build``): the packaged MiniLM for embeddings, a folder
for generation (refused without one), LoRA only for generation with --enable-lora or --lora-modules, and the
options in ``SGLangConfig``. SGLang itself is not imported until ``start``."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedmesh.models.minilm import DEFAULT_EMBEDDING_MODEL, minilm_dir
from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.registry import engine_context
from embedmesh.services.worker.engines.sglang import build
from embedmesh.services.worker.engines.sglang.engine import SGLangEngine


def _config(*argv: str) -> WorkerConfig:
    return WorkerConfig.from_args(["--engine", "sglang", *argv])


def test_embeddings_default_to_the_packaged_minilm() -> None:
    engine = build(engine_context(_config()))
    assert isinstance(engine, SGLangEngine)
    c = engine.config
    assert (c.model_path, c.served_name, c.task, c.device, c.dtype, c.max_total_tokens, c.max_running_requests,
            c.enable_lora) == (minilm_dir(), DEFAULT_EMBEDDING_MODEL, "embed", "cpu", "float32", 8192, 64, False)


def test_generation_needs_a_folder() -> None:
    with pytest.raises(ValueError, match="--engine sglang with a generative task needs --model <folder>"):
        build(engine_context(_config("--sglang-task", "generate")))


def test_generation_options_and_lora(tmp_path: Path) -> None:
    folder = tmp_path / "llm"
    c = build(engine_context(_config("--sglang-task", "generate", "--model", str(folder), "--sglang-device", "cuda",
                      "--dtype", "bfloat16", "--sglang-max-total-tokens", "64", "--max-batch-size", "5",
                      "--enable-lora"))).config  # type: ignore[attr-defined]
    assert (c.model_path, c.served_name, c.task, c.device, c.dtype, c.max_total_tokens, c.max_running_requests,
            c.enable_lora) == (folder, "llm", "generate", "cuda", "bfloat16", 64, 5, True)
    assert not build(engine_context(_config("--sglang-task", "generate", "--model", str(folder)))).config.enable_lora  # type: ignore[attr-defined]
    with_modules = build(engine_context(_config("--sglang-task", "generate", "--model", str(folder),
                                                "--served-name", "s", "--lora-modules", "a=x")))
    assert with_modules.config.enable_lora and with_modules.config.served_name == "s"  # type: ignore[attr-defined]


def test_embeddings_never_take_lora(tmp_path: Path) -> None:
    assert not build(engine_context(_config("--model", str(tmp_path), "--enable-lora"))).config.enable_lora  # type: ignore[attr-defined]

"""The ``sglang`` engine: SGLang's offline Engine for embeddings and generation (``engine.py``), its options
(``config.py``). Runs in SGLang's own venv."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.sglang.config import SGLangOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.engines.base import Engine, EngineContext

__all__ = ["SGLangOptions", "build"]


def build(context: EngineContext) -> Engine:
    """``--model default`` is the packaged all-MiniLM-L6-v2 (embeddings); generation needs a model folder."""
    from pathlib import Path

    from embedmesh.models.minilm import DEFAULT_EMBEDDING_MODEL, minilm_dir
    from embedmesh.services.worker.engines.sglang.engine import SGLangConfig, SGLangEngine

    o = context.options_as(SGLangOptions)
    task = o.sglang_task
    default = context.model in ("default", DEFAULT_EMBEDDING_MODEL)
    if default and task != "embed":
        raise ValueError("--engine sglang with a generative task needs --model <folder>")
    folder = minilm_dir() if default else Path(context.model)
    name = context.served_name or (DEFAULT_EMBEDDING_MODEL if default else folder.name)
    lora = task == "generate" and bool(context.enable_lora or context.lora_modules)
    return SGLangEngine(SGLangConfig(
        folder, name, task=task, device=o.sglang_device, dtype=o.dtype, max_total_tokens=o.sglang_max_total_tokens,
        max_running_requests=max(o.max_batch_size, 1) if task == "generate" else 64, enable_lora=lora,
    ))

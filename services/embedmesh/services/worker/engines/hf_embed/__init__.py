"""The ``hf-embed`` engine: a sentence-transformers embedding model run with transformers (``engine.py``), its
options (``config.py``); its input rules are shared with sglang in ``engines/embed_inputs.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedmesh.services.worker.engines.hf_embed.config import HFEmbedOptions

if TYPE_CHECKING:
    from embedmesh.services.worker.engines.base import Engine, EngineContext

__all__ = ["HFEmbedOptions", "build"]


def build(context: EngineContext) -> Engine:
    from pathlib import Path

    from embedmesh.models.minilm import DEFAULT_EMBEDDING_MODEL, minilm_dir
    from embedmesh.services.worker.engines.hf_embed.engine import HFEmbedConfig, HFEmbedEngine

    o = context.options_as(HFEmbedOptions)
    default = context.model in ("default", DEFAULT_EMBEDDING_MODEL)
    folder = minilm_dir() if default else Path(context.model)
    return HFEmbedEngine(HFEmbedConfig(folder, context.name_to_serve(folder.name, DEFAULT_EMBEDDING_MODEL),
                                       threads=o.threads))

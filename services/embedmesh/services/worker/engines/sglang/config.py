"""The sglang engine's options: flags and ``EMBEDMESH_WORKER_*`` variables, the older ``EMBEDMESH_SGLANG_*`` names
kept (see ``engines/options.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.core.config import option
from embedmesh.services.worker.engines import options

__all__ = ["SGLangOptions"]


@dataclass(frozen=True)
class SGLangOptions(options.EngineOptions):
    sglang_task: str = option("embed", aliases=("EMBEDMESH_SGLANG_TASK",))
    """SGLang task: "embed" (CPU or GPU) or "generate" (GPU only)."""
    sglang_device: str = option("cpu", aliases=("EMBEDMESH_SGLANG_DEVICE",))
    """SGLang device ("cpu", "cuda")."""
    sglang_max_total_tokens: int = option(8192, aliases=("EMBEDMESH_SGLANG_MAX_TOTAL_TOKENS",))
    """Size of SGLang's token pool."""
    dtype: str = options.dtype()
    max_batch_size: int = options.max_batch_size()

    def validate(self) -> None:
        if self.sglang_task not in ("embed", "generate") or self.sglang_max_total_tokens < 1:
            raise ValueError("sglang_task must be 'embed' or 'generate' and sglang_max_total_tokens >= 1")

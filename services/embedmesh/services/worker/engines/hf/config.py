"""The hf engine's options: flags and ``EMBEDMESH_WORKER_*`` variables (see ``engines/options.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.services.worker.engines import options

__all__ = ["HFOptions"]


@dataclass(frozen=True)
class HFOptions(options.EngineOptions):
    max_batch_size: int = options.max_batch_size()
    threads: int = options.threads()
    dtype: str = options.dtype()
    hf_device: str = "cpu"
    """Where the hf engine runs its model: cpu, or a CUDA device (cuda, cuda:N; needs a CUDA build of torch)."""
    hf_prefix_cache_blocks: int = 256
    """KV blocks (--block-size positions each) of earlier prompts the hf engine keeps for reuse by a later prompt with
    the same prefix, least recently used evicted first, published to the routers as KV events; 0 = off. One block
    takes layers x 2 x kv_heads x block_size x head_dim x dtype bytes (0.7 MiB for the default model in float32)."""

    def validate(self) -> None:
        if self.hf_prefix_cache_blocks < 0:
            raise ValueError(f"hf_prefix_cache_blocks must be >= 0, got {self.hf_prefix_cache_blocks}")
        d = self.hf_device
        if not (d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ValueError(f"hf_device must be cpu, cuda or cuda:N, got {d!r}")

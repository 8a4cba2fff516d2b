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

    def validate(self) -> None:
        d = self.hf_device
        if not (d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ValueError(f"hf_device must be cpu, cuda or cuda:N, got {d!r}")

"""The mocker engine's options (see ``engines/options.py``). Every field is a worker flag ``--mocker-...`` and a
variable ``EMBEDMESH_WORKER_MOCKER_...``; an impossible value is refused at start (exit status 2, naming it).

The KV block size is the worker's ``--block-size``: the simulated cache keys its blocks by the same chained hashes
the preprocessor sends the router, so there is one block size for both."""

from __future__ import annotations

import math
from dataclasses import dataclass

from embedmesh.services.worker.engines import options

__all__ = ["MockerOptions", "check_capacity"]


@dataclass(frozen=True)
class MockerOptions(options.EngineOptions):
    mocker_num_blocks: int = 2048
    """Blocks in the simulated KV cache (each holds --block-size positions); cached blocks no sequence uses are
    evicted least recently used first."""
    mocker_max_context_tokens: int = 8192
    """Longest prompt + max_tokens a request may have; the cache must hold one such request."""
    mocker_prefill_ms_per_token: float = 0.1
    """Simulated prefill time per prompt position NOT found in the cache (ms, before --mocker-speedup)."""
    mocker_decode_ms: float = 5.0
    """Simulated time of one decode step of the batch, whatever its size (ms, before --mocker-speedup)."""
    mocker_decode_ms_per_seq: float = 0.5
    """Simulated time one decode step adds per running sequence (ms, before --mocker-speedup)."""
    mocker_speedup: float = 1.0
    """Divides every simulated time (10 = ten times faster than the figures above)."""
    mocker_seed: int = 0
    """Seed of the generated token ids (with the prompt's hashes and the request's own seed)."""
    mocker_hidden_size: int = 576
    """Hidden size the mocker claims (the width prompt embeddings must have)."""
    mocker_vocab_size: int = 49152
    """Token ids generated are drawn below this."""
    max_batch_size: int = options.max_batch_size()

    def validate(self) -> None:
        for name in ("mocker_num_blocks", "mocker_max_context_tokens", "mocker_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mocker_vocab_size < 2:
            raise ValueError(f"mocker_vocab_size must be >= 2, got {self.mocker_vocab_size}")
        for name in ("mocker_prefill_ms_per_token", "mocker_decode_ms", "mocker_decode_ms_per_seq"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.mocker_speedup) and self.mocker_speedup > 0):
            raise ValueError(f"mocker_speedup must be a finite number > 0, got {self.mocker_speedup}")


def check_capacity(o: MockerOptions, block_size: int) -> None:
    """The cache must hold one request of the longest context, or such a request could never run (ValueError)."""
    need = -(-o.mocker_max_context_tokens // block_size)
    if o.mocker_num_blocks < need:
        raise ValueError(f"mocker_num_blocks ({o.mocker_num_blocks}) x block_size ({block_size}) holds fewer than "
                         f"mocker_max_context_tokens ({o.mocker_max_context_tokens}) positions: a request that "
                         f"long could never run; give at least {need} blocks or a shorter context")

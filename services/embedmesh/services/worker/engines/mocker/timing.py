"""How long the mocker's simulated work takes: prefill proportional to the positions the cache did not hold,
a decode step growing with the batch, every figure divided by the speed-up factor. Pure arithmetic, so the
scheduler's steps and the tests agree on the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Timing"]


@dataclass(frozen=True)
class Timing:
    """The timing model (``MockerOptions``' ``mocker_*_ms*`` and ``mocker_speedup``)."""

    prefill_ms_per_token: float = 0.1
    decode_ms: float = 5.0
    decode_ms_per_seq: float = 0.5
    speedup: float = 1.0

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Prefill of ``uncached_tokens`` positions (cached ones cost nothing)."""
        return uncached_tokens * self.prefill_ms_per_token / 1000.0 / self.speedup

    def decode_seconds(self, batch: int) -> float:
        """One decode step of ``batch`` running sequences (none: no step)."""
        if batch <= 0:
            return 0.0
        return (self.decode_ms + self.decode_ms_per_seq * batch) / 1000.0 / self.speedup

    def step_seconds(self, uncached_tokens: int, batch: int) -> float:
        """One scheduler step: the prefill of the sequences admitted in it, then a decode step of the batch."""
        return self.prefill_seconds(uncached_tokens) + self.decode_seconds(batch)

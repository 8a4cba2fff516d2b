"""When the L2 is worth it: per size class, is reading an entry from Redis faster than computing it again?

An L2 read costs a network transfer and an integrity digest; recomputing an entry (decoding and validating a
prompt_embeds payload) costs what the decoder costs, which for this project's torch-free decoder is close to memory
speed. Which one wins depends on the size, the machine and the Redis, so the cache learns it from what it observes:

- Entries are grouped by size class: the power of two of their byte count (``n.bit_length()``: [2**(k-1), 2**k)).
- An L1 miss always costs one L2 round trip: the entry's size is only known from its header (the first 256 KiB come
  back in the same round trip, so a small entry is read whole in it). What the rule decides is whether to take the
  rest: the bytes and their integrity digest (an L2 *hit*), or to compute the entry instead (the
  lookup that found nothing, or was declined, plus the computation).
- ``get_or_compute`` records, per class, how long each L2 hit took, each lookup that ended in a computation, and
  each computation, as seconds per byte (so sizes within a class compare), keeping the last ``window`` of each.
- Once a class has ``min_samples`` hits and computations, the L2 is used for it only while the median hit is
  faster than the median lookup-then-compute; otherwise it is skipped for that class: the lookup declines the
  transfer after the header, and nothing is written to the L2. Every decision, and every change of one, is logged
  once at debug level.
- Until a class has enough samples the L2 is used (what the cache did before it learned anything). A used class
  keeps recording hits, so a wrong "use" corrects itself. A skipped class records no more hits, so its decision
  is dropped after ``relearn_seconds`` and the class is measured again from scratch (a few L2 reads and writes
  per period at most): a "skip" taken during a noisy spell, or by conditions that have changed, does not last.

Only entries the cache can compute again are subject to it (``TieredCache.get_or_compute``); client uploads have
nothing to recompute from and always use the L2.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

from embedmesh.core.logs import get_logger

__all__ = ["SizeRule", "size_class"]

log = get_logger(__name__)


def size_class(nbytes: int) -> int:
    """``k`` such that ``2**(k-1) <= nbytes < 2**k`` (0 for 0 bytes)."""
    return max(0, int(nbytes)).bit_length()


def _span(k: int) -> str:
    def fmt(n: int) -> str:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if n >= 1 << shift:
                return f"{n / (1 << shift):g} {unit}"
        return f"{n} B"

    return fmt(0) if k == 0 else f"{fmt(1 << (k - 1))}..{fmt(1 << k)}"


class SizeRule:
    """Not thread-safe: used from one event loop."""

    def __init__(self, min_samples: int = 5, window: int = 16, relearn_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError("need 1 <= min_samples <= window")
        self.min_samples = min_samples
        self.window = window
        self.relearn_seconds = relearn_seconds
        self._clock = clock
        self._l2: dict[int, deque[float]] = {}
        self._lookup: dict[int, deque[float]] = {}
        self._compute: dict[int, deque[float]] = {}
        self._use: dict[int, bool] = {}
        self._skipped_since: dict[int, float] = {}

    def use_l2(self, nbytes: int) -> bool:
        """Whether to read and write the L2 for an entry of ``nbytes`` (True until the class has been measured)."""
        k = size_class(nbytes)
        use = self._use.get(k, True)
        if not use and self._clock() - self._skipped_since[k] >= self.relearn_seconds:
            for table in (self._l2, self._lookup, self._compute, self._use, self._skipped_since):
                table.pop(k, None)
            log.debug("encoder cache L2 measured again for entries of %s", _span(k), extra={"size_class": k})
            return True
        return use

    def decided(self) -> dict[int, bool]:
        """Size class -> use the L2, for the classes measured so far."""
        return dict(self._use)

    def record_l2(self, nbytes: int, seconds: float) -> None:
        """An L2 hit of ``nbytes`` took ``seconds`` (header, transfer and integrity check)."""
        self._record(self._l2, nbytes, seconds)

    def record_lookup(self, nbytes: int, seconds: float) -> None:
        """An L2 lookup that served nothing (absent, or declined after the header) took ``seconds``; the entry then
        computed was ``nbytes``."""
        self._record(self._lookup, nbytes, seconds)

    def record_compute(self, nbytes: int, seconds: float) -> None:
        """Computing an entry of ``nbytes`` (what an L2 hit would have saved) took ``seconds``."""
        self._record(self._compute, nbytes, seconds)

    def _record(self, table: dict[int, deque[float]], nbytes: int, seconds: float) -> None:
        k = size_class(nbytes)
        table.setdefault(k, deque(maxlen=self.window)).append(max(seconds, 0.0) / max(int(nbytes), 1))
        l2, compute, lookup = self._l2.get(k, ()), self._compute.get(k, ()), self._lookup.get(k, ())
        if len(l2) < self.min_samples or len(compute) < self.min_samples:
            return
        l2_rate = statistics.median(l2)
        compute_rate = statistics.median(compute) + (statistics.median(lookup) if lookup else 0.0)
        use = l2_rate < compute_rate
        if self._use.get(k) != use:
            self._use[k] = use
            if not use:
                self._skipped_since[k] = self._clock()
            log.debug("encoder cache L2 %s for entries of %s: L2 hit %.0f MB/s, lookup and compute %.0f MB/s",
                      "used" if use else "skipped", _span(k), 1e-6 / l2_rate if l2_rate else float("inf"),
                      1e-6 / compute_rate if compute_rate else float("inf"),
                      extra={"size_class": k, "use_l2": use})

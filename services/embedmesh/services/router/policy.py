"""One routing decision: validate, look up every candidate's cached prefix, score, choose, record, report.

The decision is logged (one structured line: chosen worker, overlap, the cheapest few candidates' costs) and
counted in Prometheus (decisions by hit/miss, overlap ratio), and returned whole so ``Route`` can show it.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from embedmesh.core.block_hash import ROOT
from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.router.metrics import DECISIONS, MATCHED_BLOCKS, OVERLAP
from embedmesh.services.router.registry import Registry
from embedmesh.services.router.scoring import Scored, Weights, choose, choose_blind, score

__all__ = ["Decision", "KvRouter", "LOGGED_CANDIDATES"]

log = get_logger("embedmesh.router.decisions")


LOGGED_CANDIDATES = 4
"""Candidates (cheapest first) whose cost goes into the decision's log line."""


@dataclass(frozen=True)
class Decision:
    worker_id: str
    address: str
    overlap_blocks: int
    candidates: list[tuple[Scored, str]]
    """Every candidate with its address, cheapest first."""
    adapter_missing: bool = False
    """The request names an adapter no worker of the model holds: chosen by load alone (see ``route``)."""


class KvRouter:
    """Chooses a worker for a prompt from the registry's live workers and the KV index."""

    def __init__(self, registry: Registry, weights: Weights, rng: random.Random | None = None,
                 mode: str = "kv") -> None:
        self.registry = registry
        self.weights = weights
        self.rng = rng or random.Random()
        self.mode = mode
        """"kv", or a baseline ("round-robin", "random": ``scoring.choose_blind``) to measure it against."""
        self.routes = 0

    def route(self, model: str, hashes: Sequence[int], block_size: int, prompt_tokens: int,
              request_id: str = "", adapter: str = "") -> Decision:
        """The cheapest worker of ``model`` for the prompt. With ``adapter``, only workers holding that LoRA
        adapter are candidates (``hashes`` are then the adapter's chain, so overlaps never cross adapters); when
        none holds it, the least-loaded worker of the model is returned with ``adapter_missing`` set, for a caller
        that loads adapters on demand."""
        if not model:
            raise InvalidArgument("model: is required", field="model", reason="REQUIRED")
        if block_size < 1:
            raise InvalidArgument(f"block_size: must be >= 1, got {block_size}", field="block_size",
                                  reason="OUT_OF_RANGE")
        if prompt_tokens < 1:
            raise InvalidArgument(f"prompt_tokens: must be >= 1, got {prompt_tokens}", field="prompt_tokens",
                                  reason="OUT_OF_RANGE")
        if len(hashes) > prompt_tokens // block_size:
            raise InvalidArgument(
                f"block_hashes: {len(hashes)} hashes but a prompt of {prompt_tokens} positions has only "
                f"{prompt_tokens // block_size} full blocks of {block_size}", field="block_hashes",
                reason="TOO_MANY_HASHES")
        if ROOT in hashes:
            raise InvalidArgument("block_hashes: 0 is the root, never a block's hash", field="block_hashes",
                                  reason="ROOT_HASH")
        candidates = self.registry.candidates(model)
        if not candidates:
            raise Unavailable(f"model: no live worker serves {model!r}", field="model", reason="NO_WORKER")
        matching = {w.worker_id: w for w in candidates if w.block_size == block_size}
        if not matching:
            sizes = sorted({w.block_size for w in candidates})
            raise InvalidArgument(f"block_size: workers of {model!r} use block sizes {sizes}, got {block_size}",
                                  field="block_size", reason="BLOCK_SIZE_MISMATCH")
        adapter_missing = False
        if adapter:
            holders = {wid: w for wid, w in matching.items() if adapter in w.adapters}
            if holders:
                matching = holders
            else:
                adapter_missing = True
        overlaps = self.registry.index.find_matches(hashes) if hashes else {}
        prompt_blocks = max(len(hashes), math.ceil(prompt_tokens / block_size))
        scored = score(prompt_blocks, overlaps, {wid: w.load for wid, w in matching.items()}, self.weights)
        best = choose(scored, self.weights, self.rng) if self.mode == "kv" else \
            choose_blind(scored, self.mode, self.routes, self.rng)
        self.registry.record_routed(best.worker_id, hashes)
        self.routes += 1
        DECISIONS.labels(model, "yes" if best.overlap else "no").inc()
        if hashes:
            OVERLAP.labels(model).observe(best.overlap / len(hashes))
            MATCHED_BLOCKS.labels(model, "prompt").inc(len(hashes))
            MATCHED_BLOCKS.labels(model, "cached").inc(best.overlap)
        if log.isEnabledFor(logging.DEBUG):  # one line per request: EMBEDMESH_LOG_LEVEL=DEBUG shows them
            log.debug("route", extra={
                "request_id": request_id, "model": model, "adapter": adapter, "worker_id": best.worker_id,
                "overlap_blocks": best.overlap,
                "prompt_blocks": len(hashes), "candidates": len(scored),
                "costs": {s.worker_id: round(s.cost, 3) for s in scored[:LOGGED_CANDIDATES]}})
        return Decision(best.worker_id, matching[best.worker_id].address, best.overlap,
                        [(s, matching[s.worker_id].address) for s in scored], adapter_missing)

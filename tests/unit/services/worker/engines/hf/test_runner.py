"""The runner's batch cache: rows merged left-padded to the longer one, ended rows dropped with the columns that are
padding in every row left (no model loaded: a cache of plain tensors)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from embedmesh.services.worker.engines.hf.runner import HFEngineConfig, ModelRunner

torch = pytest.importorskip("torch")


def _runner() -> ModelRunner:
    r = ModelRunner(HFEngineConfig(Path("."), "m"))
    r.torch = torch
    return r


def _cache(rows: int, t: int) -> Any:
    layer = SimpleNamespace(keys=torch.ones(rows, 1, t, 2), values=torch.ones(rows, 1, t, 2))
    return SimpleNamespace(layers=[layer])


def test_merge_pads_left_and_drop_trims_dead_columns() -> None:
    r = _runner()
    mask = torch.ones(1, 2, dtype=torch.long)
    new_mask = torch.tensor([[0, 1, 1, 1]])
    cache = r.merge(_cache(1, 2), mask, _cache(1, 4), new_mask)
    both = r.cat_mask(mask, new_mask)
    assert cache.layers[0].keys.shape == (2, 1, 4, 2) and both.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    rows = [SimpleNamespace(done=False), SimpleNamespace(done=True)]
    cache, left, kept = r.drop(cache, both, rows)
    assert kept == rows[:1] and left.tolist() == [[1, 1]] and cache.layers[0].keys.shape == (1, 1, 2, 2)

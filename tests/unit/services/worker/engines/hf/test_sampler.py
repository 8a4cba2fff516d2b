"""The sampler without a model: greedy below GREEDY_BELOW and with top_k 1, top_p keeping the most likely token,
and a row of non-finite logits failing alone (NON_FINITE_COMPUTATION naming the prompt's field)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import EngineStats, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.hf.runner import HFEngineConfig, ModelRunner
from embedmesh.services.worker.engines.hf.sampler import GREEDY_BELOW, Sampler
from embedmesh.services.worker.engines.hf.sequence import Seq

torch = pytest.importorskip("torch")


def _sampler() -> Sampler:
    runner = ModelRunner(HFEngineConfig(Path("."), "m"))
    runner.torch = torch
    return Sampler(runner, EngineStats())


def _seq(loop: asyncio.AbstractEventLoop, **sampling: float) -> Seq:
    s = Seq(GenerationRequest("r", [TokenSegment((1,))], SamplingParams(**sampling)), asyncio.Queue(), loop,
            detok=None)
    s.generator = torch.Generator().manual_seed(0)
    return s


async def test_greedy_and_top_p() -> None:
    loop = asyncio.get_running_loop()
    sampler = _sampler()
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert sampler.sample(logits, _seq(loop, temperature=GREEDY_BELOW / 2)) == 1
    assert sampler.sample(logits, _seq(loop, temperature=1.0, top_k=1)) == 1
    assert sampler.sample(logits, _seq(loop, temperature=1.0, top_p=1e-6)) == 1


async def test_a_non_finite_row_fails_alone() -> None:
    seq = _seq(asyncio.get_running_loop(), temperature=1.0)
    _sampler().sample_rows(torch.tensor([[float("nan"), 0.0]]), [seq])
    await asyncio.sleep(0)
    err = seq.out.get_nowait()
    assert isinstance(err, InvalidArgument) and err.reason == "NON_FINITE_COMPUTATION" and err.field == "prompt"

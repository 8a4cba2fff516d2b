"""The hf embedding engine on the real all-MiniLM-L6-v2: vectors equal sentence-transformers' to 1e-5, concurrent
requests share forward passes, dimensions and bad inputs behave as documented."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.models.minilm import minilm_dir
from embedmesh.services.worker.engines.hf_embed import HFEmbedConfig, HFEmbedEngine

SENTENCES = ["The cat sits on the mat.", "A quick brown fox", "embedmesh serves embeddings", "x", "Ünïcödé ✓ 東京"]


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[HFEmbedEngine]:
    e = HFEmbedEngine(HFEmbedConfig(minilm_dir(), "all-MiniLM-L6-v2", max_batch_inputs=32))
    await e.start()
    yield e
    await e.shutdown()


@pytest.fixture(scope="module")
def reference() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")


async def test_vectors_equal_sentence_transformers(engine: HFEmbedEngine, reference: Any) -> None:
    ours, tokens = await engine.embed(list(SENTENCES))
    theirs = reference.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=False)
    assert ours.shape == (5, 384)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert tokens == [len(reference.tokenizer(s)["input_ids"]) for s in SENTENCES]


async def test_token_id_inputs_equal_text_inputs(engine: HFEmbedEngine) -> None:
    ids = engine.tokenizer("The cat sits on the mat.")["input_ids"]
    by_ids, _ = await engine.embed([ids])
    by_text, _ = await engine.embed(["The cat sits on the mat."])
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)


async def test_concurrent_requests_share_forward_passes(engine: HFEmbedEngine) -> None:
    before = engine.forward_passes
    results = await asyncio.gather(*[engine.embed([s]) for s in SENTENCES * 4])
    assert engine.forward_passes - before < len(results)
    alone, _ = await engine.embed([SENTENCES[1]])
    np.testing.assert_allclose(results[1][0], alone, atol=1e-5)


async def test_dimensions() -> None:
    e = HFEmbedEngine(HFEmbedConfig(minilm_dir(), "matryoshka-test", supports_dimensions=True))
    await e.start()
    full, _ = await e.embed(["hello world"])
    short, _ = await e.embed(["hello world"], dimensions=64)
    await e.shutdown()
    assert short.shape == (1, 64)
    np.testing.assert_allclose(short[0], full[0, :64] / np.linalg.norm(full[0, :64]), atol=1e-6)


@pytest.mark.parametrize(
    "inputs,dimensions,field",
    [
        (["word " * 400], None, "input"),
        (["ok", "word " * 400], None, "input[1]"),
        ([[1, 2, 10**6]], None, "input"),
        (["hello"], 64, "dimensions"),
        (["hello"], 385, "dimensions"),
    ],
)
async def test_bad_inputs(engine: HFEmbedEngine, inputs: list[Any], dimensions: int | None, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await engine.embed(inputs, dimensions)
    assert info.value.field == field
    ok, _ = await engine.embed(["still serving"])
    assert ok.shape == (1, 384)

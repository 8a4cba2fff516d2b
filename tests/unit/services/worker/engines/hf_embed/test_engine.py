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
from embedmesh.services.worker.engines.hf_embed.engine import HFEmbedConfig, HFEmbedEngine

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


def test_a_lone_request_is_not_held_back_for_company() -> None:
    """By default the engine takes what waits and starts: collecting never blocks on the inbox (it used to wait
    2 ms for more requests after every first one, which each request paid at low load)."""
    import queue

    class Recording(queue.Queue):  # type: ignore[type-arg]
        blocking_gets: list[Any] = []

        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            if block:
                self.blocking_gets.append(timeout)
            return super().get(block, timeout)

    from types import SimpleNamespace

    e = HFEmbedEngine(HFEmbedConfig(minilm_dir(), "all-MiniLM-L6-v2"))
    e._inbox = Recording()
    first = SimpleNamespace(inputs=["a"])
    assert e._collect(first) == [first]  # type: ignore[arg-type]
    queued = [SimpleNamespace(inputs=["b"]), SimpleNamespace(inputs=["c", "d"])]
    for job in queued:
        e._inbox.put(job)  # type: ignore[arg-type]
    assert e._collect(first) == [first, *queued]  # type: ignore[arg-type]
    assert Recording.blocking_gets == []
    waiting = HFEmbedEngine(HFEmbedConfig(minilm_dir(), "all-MiniLM-L6-v2", batch_wait_ms=5))
    waiting._inbox = Recording()
    assert waiting._collect(first) == [first]  # type: ignore[arg-type]
    assert Recording.blocking_gets == [0.005]


async def test_dimensions() -> None:
    e = HFEmbedEngine(HFEmbedConfig(minilm_dir(), "matryoshka-test", supports_dimensions=True))
    await e.start()
    full, _ = await e.embed(["hello world"])
    short, _ = await e.embed(["hello world"], dimensions=64)
    with pytest.raises(InvalidArgument) as too_big:
        await e.embed(["hello world"], dimensions=385)
    await e.shutdown()
    assert short.shape == (1, 64)
    np.testing.assert_allclose(np.linalg.norm(short[0]), 1.0, atol=1e-6)
    np.testing.assert_allclose(short[0], full[0, :64] / np.linalg.norm(full[0, :64]), atol=1e-6)
    assert too_big.value.field == "dimensions" and too_big.value.reason == "OUT_OF_RANGE"


@pytest.mark.parametrize(
    "inputs,dimensions,field",
    [
        (["word " * 400], None, "input"),
        (["ok", "word " * 400], None, "input[1]"),
        ([[1, 2, 10**6]], None, "input"),
        (["hello"], 64, "dimensions"),
        (["hello"], 385, "dimensions"),
        (["hello"], 0, "dimensions"),
    ],
)
async def test_bad_inputs(engine: HFEmbedEngine, inputs: list[Any], dimensions: int | None, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await engine.embed(inputs, dimensions)
    assert info.value.field == field
    ok, _ = await engine.embed(["still serving"])
    assert ok.shape == (1, 384)


async def test_uneven_lengths_in_one_batch_equal_sentence_transformers(engine: HFEmbedEngine, reference: Any) -> None:
    # Padding must not leak into the mean: a 2-token and a ~200-token input share one forward pass.
    texts = ["hi", "a long sentence about many things " * 25, "mid length input here"]
    before = engine.forward_passes
    ours, _ = await engine.embed(texts)
    assert engine.forward_passes - before == 1
    np.testing.assert_allclose(ours, reference.encode(texts, convert_to_numpy=True), atol=1e-5)


async def test_full_size_dimensions_is_a_no_op(engine: HFEmbedEngine) -> None:
    full, _ = await engine.embed(["hello world"])
    same, _ = await engine.embed(["hello world"], dimensions=384)
    np.testing.assert_array_equal(full, same)


async def test_a_bad_request_does_not_fail_the_requests_batched_with_it(engine: HFEmbedEngine) -> None:
    good, bad = await asyncio.gather(engine.embed(["fine"]), engine.embed([[5, -1]]), return_exceptions=True)
    assert isinstance(bad, InvalidArgument) and bad.field == "input"
    assert not isinstance(good, BaseException) and good[0].shape == (1, 384)


@pytest.mark.parametrize(
    "inputs,field,reason",
    [
        ([""], "input", "EMPTY_INPUT"),
        (["ok", ""], "input[1]", "EMPTY_INPUT"),
        ([[]], "input", "EMPTY_INPUT"),
        ([[101, -1, 102]], "input", "TOKEN_OUT_OF_RANGE"),
        (["ok", [101, 30522, 102]], "input[1]", "TOKEN_OUT_OF_RANGE"),
        ([[101] + [1000] * 255 + [102]], "input", "INPUT_TOO_LONG"),  # 257 ids > max_seq_length 256
        (["ok", "fine", "word " * 300], "input[2]", "INPUT_TOO_LONG"),
    ],
)
async def test_bad_input_table(engine: HFEmbedEngine, inputs: list[Any], field: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await engine.embed(inputs)
    assert (info.value.field, info.value.reason) == (field, reason)
    assert field in info.value.message


async def test_longest_accepted_input(engine: HFEmbedEngine) -> None:
    vec, tokens = await engine.embed([[101] + [1000] * 254 + [102]])
    assert tokens == [256] and vec.shape == (1, 384)


def test_info_describes_an_embedding_model(engine: HFEmbedEngine) -> None:
    info = engine.info()
    assert (info.task, info.embedding_size, info.max_context_tokens, info.vocab_size) == ("embed", 384, 256, 30522)
    assert info.supports_dimensions is False


def test_generate_is_refused(engine: HFEmbedEngine) -> None:
    from embedmesh.services.worker.engines.base import GenerationRequest

    with pytest.raises(InvalidArgument) as info:
        engine.generate(GenerationRequest("r", []))
    assert info.value.field == "model"


def test_pooling_spec_is_read_from_the_folder(tmp_path: Any) -> None:
    import json

    from embedmesh.services.worker.engines.embed_inputs import read_pooling_spec

    spec = read_pooling_spec(minilm_dir(), 512)
    assert (spec.pooling, spec.normalize, spec.max_tokens) == ("mean", True, 256)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "", "type": "x.Transformer"},
                                                       {"path": "1_Pooling", "type": "x.Pooling"}]))
    spec = read_pooling_spec(tmp_path, 512)
    assert (spec.pooling, spec.normalize, spec.max_tokens) == ("cls", False, 512)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="not supported"):
        read_pooling_spec(tmp_path, 512)

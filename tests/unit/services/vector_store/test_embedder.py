"""vector_store.embedder: texts go to ``InferenceService.Embed`` in batches of ``batch_size`` (the fake embedder in
a real gRPC server), rows come back unit-length in input order, a model of another dimension is DIMENSION_MISMATCH,
a failing model's error keeps its class and field and names the model and address."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from embedmesh.core.errors import InternalError, Unavailable
from embedmesh.services.vector_store.embedder import DimensionMismatch, Embedder, normalise
from tests.unit.services.vector_store.fake_embedder import FakeEmbedder, bag_of_words


@pytest.fixture
async def embedder(fake_embedder: FakeEmbedder) -> AsyncIterator[Embedder]:
    e = Embedder(fake_embedder.address, "minilm", dimensions=384, batch_size=3)
    yield e
    await e.close()


async def test_texts_are_embedded_in_batches_in_order(embedder: Embedder, fake_embedder: FakeEmbedder) -> None:
    texts = [f"text number {i} about topic {i % 3}" for i in range(7)]
    got = await embedder.embed(texts)
    assert got.shape == (7, 384) and got.dtype == np.float32
    assert fake_embedder.calls == 3 and fake_embedder.texts == 7  # 3 + 3 + 1
    for row, text in zip(got, texts, strict=True):
        assert np.allclose(row, bag_of_words(text), atol=1e-6)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


async def test_no_texts_no_call(embedder: Embedder, fake_embedder: FakeEmbedder) -> None:
    got = await embedder.embed([])
    assert got.shape == (0, 384) and fake_embedder.calls == 0


async def test_a_model_of_another_dimension_is_refused(fake_embedder: FakeEmbedder) -> None:
    e = Embedder(fake_embedder.address, "minilm", dimensions=768)
    try:
        with pytest.raises(DimensionMismatch) as info:
            await e.embed(["hello"])
    finally:
        await e.close()
    assert isinstance(info.value, InternalError) and info.value.reason == "DIMENSION_MISMATCH"
    assert info.value.message == ("embedding model 'minilm' returned 384-d vectors but the vector store is "
                                  "configured for 768")


async def test_a_failing_model_keeps_its_error_class_and_names_itself(embedder: Embedder,
                                                                      fake_embedder: FakeEmbedder) -> None:
    fake_embedder.fail_with = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Unavailable) as info:
        await embedder.embed_batch(["hello"])
    assert info.value.message == (f"embedding model 'minilm' at {fake_embedder.address}: fake embedder told to "
                                  "fail")
    fake_embedder.fail_with = None
    assert (await embedder.embed_batch(["hello"])).shape == (1, 384), "the next call works again"


async def test_nobody_listening_is_unavailable() -> None:
    e = Embedder("127.0.0.1:1", "minilm", dimensions=384, timeout_seconds=5)
    try:
        with pytest.raises(Unavailable, match="embedding model 'minilm' at 127.0.0.1:1"):
            await e.embed_batch(["x"])
    finally:
        await e.close()


def test_normalise_makes_unit_rows_and_refuses_non_finite_values() -> None:
    rows = np.array([[3.0, 4.0], [0.0, 0.0], [-2.0, 0.0]], np.float64)
    got = normalise(rows)
    assert got.dtype == np.float32
    assert np.allclose(got, [[0.6, 0.8], [0.0, 0.0], [-1.0, 0.0]])  # a zero row stays zero, no division by zero
    for bad in (np.nan, np.inf):
        with pytest.raises(InternalError, match="NaN or Inf"):
            normalise(np.array([[1.0, bad]]))


async def test_the_models_input_length_is_kept_only_once_the_mesh_lists_it() -> None:
    """A vector store started before its embedding worker sees no model in ListModels: that 0 is not kept, so the
    next file's auto chunking gets the real length (the model listed later), which is then asked no more."""
    from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc

    answers = [[], [inference_pb2.Model(id="all-MiniLM-L6-v2", max_context_tokens=256, task="embed")]]
    calls = []

    class Servicer(inference_pb2_grpc.InferenceServiceServicer):
        async def ListModels(self, request, context):  # noqa: N802, ANN001, ANN201
            calls.append(1)
            return inference_pb2.ListModelsResponse(models=answers[min(len(calls), len(answers)) - 1])

    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    e = Embedder(f"127.0.0.1:{port}", "all-MiniLM-L6-v2", 384)
    try:
        assert await e.max_input_tokens() == 0  # the worker is not up yet: nothing listed
        assert await e.max_input_tokens() == 256
        assert await e.max_input_tokens() == 256
        assert len(calls) == 2, "a real answer is kept"
    finally:
        await e.close()
        await server.stop(None)

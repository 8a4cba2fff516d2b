"""The preprocessor's embeddings domain against scripted workers: validation before any worker call, the cache
keyed by (model, dimensions, input), single flight, fan-out in chunks, errors renamed to the client's numbering."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument, to_status
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.services.preprocessor import embedding_requests
from embedmesh.services.preprocessor.embedding_requests import MAX_INPUTS, EmbedModelSpec, embed_inputs, validate_inputs
from embedmesh.worker.v1 import worker_pb2

DIM = 8
INFO = worker_pb2.GetInfoResponse(model="mini", vocab_size=1000, max_context_tokens=16, embedding_size=DIM,
                                  task=worker_pb2.MODEL_TASK_EMBED)


def vector(item: Any) -> np.ndarray:
    """A deterministic unit vector per input, so tests can check which row landed where."""
    seed = sum(map(ord, item)) if isinstance(item, str) else sum(item) + 7
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, err: InvalidArgument) -> None:
        status = to_status(err)
        super().__init__(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
                         details=status.details)


@dataclass
class _Stub:
    calls: list[worker_pb2.EmbedRequest] = field(default_factory=list)
    delay: float = 0.0
    fail_on: str | None = None

    async def Embed(self, req: worker_pb2.EmbedRequest, timeout: float) -> worker_pb2.EmbedResponse:  # noqa: N802
        self.calls.append(req)
        await asyncio.sleep(self.delay)
        items = [i.text if i.WhichOneof("kind") == "text" else list(i.token_ids.ids) for i in req.inputs]
        for j, item in enumerate(items):
            if item == self.fail_on:
                name = "input" if len(items) == 1 else f"input[{j}]"
                raise _RpcError(InvalidArgument(f"{name}: too long", field=name, reason="INPUT_TOO_LONG"))
        vecs = np.stack([vector(x) for x in items])
        if req.HasField("dimensions"):
            vecs = vecs[:, :req.dimensions] / np.linalg.norm(vecs[:, :req.dimensions], axis=1, keepdims=True)
        counts = [len(x) if isinstance(x, list) else len(x.split()) + 2 for x in items]
        return worker_pb2.EmbedResponse(embeddings=tensors.from_numpy(vecs.astype(np.float32)),
                                        prompt_tokens=sum(counts), input_tokens=counts)


@dataclass
class _Worker:
    stub: _Stub
    inflight: int = 0


class _Pool:
    def __init__(self, n: int = 1, info: worker_pb2.GetInfoResponse = INFO) -> None:
        self.workers = [_Worker(_Stub()) for _ in range(n)]
        self.info = info
        self._next = 0

    def spec(self, model: str) -> worker_pb2.GetInfoResponse:
        if model != self.info.model:
            raise InvalidArgument(f"model {model!r} is not served here", field="model")
        return self.info

    def pick(self, model: str) -> _Worker:
        self._next += 1
        return self.workers[self._next % len(self.workers)]

    @property
    def calls(self) -> list[worker_pb2.EmbedRequest]:
        return [c for w in self.workers for c in w.stub.calls]


@pytest.fixture
def cache() -> TieredCache:
    return TieredCache(CacheConfig(capacity_bytes=1 << 20))


async def test_vectors_in_input_order_with_usage(cache: TieredCache) -> None:
    pool = _Pool()
    inputs: list[Any] = ["one two", [5, 6, 7], "three"]
    vecs, tokens = await embed_inputs(pool, cache, "mini", inputs, None)  # type: ignore[arg-type]
    np.testing.assert_array_equal(vecs, np.stack([vector(x) for x in inputs]))
    assert tokens == 4 + 3 + 3


async def test_second_call_does_not_reach_the_worker(cache: TieredCache) -> None:
    pool = _Pool()
    first, t1 = await embed_inputs(pool, cache, "mini", ["cached text"], None)  # type: ignore[arg-type]
    again, t2 = await embed_inputs(pool, cache, "mini", ["cached text"], None)  # type: ignore[arg-type]
    assert len(pool.calls) == 1
    np.testing.assert_array_equal(first, again)
    assert t1 == t2 == 4, "usage counts cached inputs too"


async def test_only_missing_inputs_are_sent_and_duplicates_once(cache: TieredCache) -> None:
    pool = _Pool()
    await embed_inputs(pool, cache, "mini", ["a"], None)  # type: ignore[arg-type]
    vecs, _ = await embed_inputs(pool, cache, "mini", ["b", "a", "b", "c"], None)  # type: ignore[arg-type]
    assert [i.text for i in pool.calls[1].inputs] == ["b", "c"]
    np.testing.assert_array_equal(vecs, np.stack([vector(x) for x in ["b", "a", "b", "c"]]))


async def test_cache_key_separates_model_dimensions_and_kind() -> None:
    k = embedding_requests.cache_key
    assert len({k("m", None, "12"), k("n", None, "12"), k("m", 4, "12"), k("m", None, [12])}) == 4
    assert k("m", None, [1, 2]) == k("m", None, [1, 2])


async def test_full_size_dimensions_shares_the_cache_with_unset(cache: TieredCache) -> None:
    pool = _Pool()
    await embed_inputs(pool, cache, "mini", ["x y"], None)  # type: ignore[arg-type]
    await embed_inputs(pool, cache, "mini", ["x y"], DIM)  # type: ignore[arg-type]
    assert len(pool.calls) == 1 and not pool.calls[0].HasField("dimensions")


async def test_shortened_vectors_are_cached_apart(cache: TieredCache) -> None:
    info = worker_pb2.GetInfoResponse()
    info.CopyFrom(INFO)
    info.supports_dimensions = True
    pool = _Pool(info=info)
    full, _ = await embed_inputs(pool, cache, "mini", ["x y"], None)  # type: ignore[arg-type]
    short, _ = await embed_inputs(pool, cache, "mini", ["x y"], 4)  # type: ignore[arg-type]
    assert short.shape == (1, 4) and len(pool.calls) == 2 and pool.calls[1].dimensions == 4
    np.testing.assert_allclose(short[0], full[0, :4] / np.linalg.norm(full[0, :4]), atol=1e-6)


async def test_concurrent_requests_for_the_same_input_compute_it_once(cache: TieredCache) -> None:
    pool = _Pool()
    pool.workers[0].stub.delay = 0.05
    results = await asyncio.gather(*[embed_inputs(pool, cache, "mini", ["same"], None)  # type: ignore[arg-type]
                                     for _ in range(5)])
    assert len(pool.calls) == 1
    for vecs, _ in results:
        np.testing.assert_array_equal(vecs, results[0][0])


async def test_large_requests_fan_out_in_chunks(cache: TieredCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedding_requests, "INPUTS_PER_CALL", 4)
    pool = _Pool(n=2)
    inputs = [f"text {i}" for i in range(10)]
    vecs, _ = await embed_inputs(pool, cache, "mini", inputs, None)  # type: ignore[arg-type]
    assert sorted(len(c.inputs) for c in pool.calls) == [2, 4, 4]
    assert all(w.stub.calls for w in pool.workers), "both workers got work"
    np.testing.assert_array_equal(vecs, np.stack([vector(x) for x in inputs]))


async def test_worker_errors_name_the_clients_input(cache: TieredCache) -> None:
    pool = _Pool()
    pool.workers[0].stub.fail_on = "way too long"
    await embed_inputs(pool, cache, "mini", ["cached"], None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as info:
        # The worker sees ["fine", "way too long"] and blames its input[1]; the client knows it as input[2].
        await embed_inputs(pool, cache, "mini", ["cached", "fine", "way too long"], None)  # type: ignore[arg-type]
    assert info.value.field == "input[2]" and info.value.message.startswith("input[2]:")
    with pytest.raises(InvalidArgument) as single:
        await embed_inputs(pool, cache, "mini", ["cached", "way too long"], None)  # type: ignore[arg-type]
    assert single.value.field == "input[1]", "the worker said 'input' (one input sent)"
    vecs, _ = await embed_inputs(pool, cache, "mini", ["fine"], None)  # type: ignore[arg-type]
    assert vecs.shape == (1, DIM)


SPEC = EmbedModelSpec("mini", vocab_size=1000, max_tokens=16, embedding_size=DIM, supports_dimensions=False)


@pytest.mark.parametrize(
    "inputs,dimensions,field,reason",
    [
        ([], None, "input", "EMPTY_INPUT"),
        ([""], None, "input", "EMPTY_INPUT"),
        (["ok", ""], None, "input[1]", "EMPTY_INPUT"),
        ([[]], None, "input", "EMPTY_INPUT"),
        ([[1, -2]], None, "input", "TOKEN_OUT_OF_RANGE"),
        (["ok", [1, 1000]], None, "input[1]", "TOKEN_OUT_OF_RANGE"),
        ([[1] * 17], None, "input", "INPUT_TOO_LONG"),
        (["x"] * (MAX_INPUTS + 1), None, "input", "TOO_MANY_INPUTS"),
        (["ok"], 4, "dimensions", "DIMENSIONS_UNSUPPORTED"),
        (["ok"], DIM + 1, "dimensions", "OUT_OF_RANGE"),
        (["ok"], 0, "dimensions", "OUT_OF_RANGE"),
    ],
)
def test_validation_table(inputs: list[Any], dimensions: int | None, field: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_inputs(inputs, dimensions, SPEC)
    assert (info.value.field, info.value.reason) == (field, reason)


def test_validation_accepts_the_limits() -> None:
    assert validate_inputs(["x"] * MAX_INPUTS, DIM, SPEC) is None
    assert validate_inputs([[0, 999] * 8], None, SPEC) is None


async def test_bad_input_never_reaches_a_worker(cache: TieredCache) -> None:
    pool = _Pool()
    with pytest.raises(InvalidArgument):
        await embed_inputs(pool, cache, "mini", ["ok", [1, 5000]], None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as info:
        await embed_inputs(pool, cache, "other", ["ok"], None)  # type: ignore[arg-type]
    assert info.value.field == "model" and pool.calls == []


def test_a_cache_entry_holds_the_vector_and_its_token_count() -> None:
    import numpy as np

    from embedmesh.services.preprocessor.embedding_requests import (
        MAX_CACHED_TOKENS,
        pack_entry,
        unpack_entries,
    )

    a, b = np.array([0.5, -1.0, 2.0], np.float32), np.array([1.0, 0.0, 3.5], np.float32)
    vectors, tokens = unpack_entries([pack_entry(a, 7), pack_entry(b, MAX_CACHED_TOKENS - 1)])
    assert vectors.tolist() == [a.tolist(), b.tolist()] and vectors.dtype == np.float32
    assert tokens == 7 + MAX_CACHED_TOKENS - 1, "counts stay exact up to the bound"
    with pytest.raises(ValueError, match="token counts below"):
        pack_entry(a, MAX_CACHED_TOKENS)

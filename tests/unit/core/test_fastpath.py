"""core.fastpath: ``EMBEDMESH_FASTPATH=off`` turns every performance bypass to its plain path, and each plain path
gives what the bypass gives (the e2e suites run both ways: ``make test-plain``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core import fastpath, grpc_runtime
from embedmesh.core.transport import wire
from embedmesh.core.transport.received import Received
from embedmesh.inference.v1 import inference_pb2
from embedmesh.services.preprocessor.servicer import InferenceServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2
from tests.unit.core.transport.test_wire import _reference


@pytest.mark.parametrize("value,on", [(None, True), ("on", True), ("1", True), ("", True), ("off", False),
                                      ("OFF", False), (" 0 ", False), ("false", False), ("no", False)])
def test_the_switch_reads_off_values_and_defaults_to_on(value: str | None, on: bool) -> None:
    assert fastpath.enabled({} if value is None else {fastpath.ENV: value}) is on


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fastpath.ENV, "off")


def _request() -> tuple[worker_pb2.GenerateRequest, list, int]:
    rows = np.random.default_rng(0).standard_normal((37, 24)).astype(np.float32)
    header = worker_pb2.GenerateRequest(request_id="r-1", lora_adapter="sql",
                                        sampling=common_pb2.SamplingParams(max_tokens=7, temperature=0.5))
    return header, [(1, 2, 300), rows, (5,), rows[:1]], tensor_pb2.DATA_TYPE_FP32


def test_off_the_worker_request_is_protobufs_own_serialization(plain: None) -> None:
    header, pieces, dtype = _request()
    body = wire.generate_request_bytes(header, pieces, dtype)
    assert body == _reference(header, pieces, dtype).SerializeToString()


def test_both_paths_give_the_same_worker_request(monkeypatch: pytest.MonkeyPatch) -> None:
    header, pieces, dtype = _request()
    fast = wire.generate_request_bytes(header, pieces, dtype)
    monkeypatch.setenv(fastpath.ENV, "off")
    slow = wire.generate_request_bytes(header, pieces, dtype)
    assert fast != slow  # the fast path writes the segments after the header: different bytes ...
    assert worker_pb2.GenerateRequest.FromString(fast) == worker_pb2.GenerateRequest.FromString(slow)  # same message


def test_off_received_tensors_are_parsed_by_protobuf_not_cut_out(monkeypatch: pytest.MonkeyPatch) -> None:
    header, pieces, dtype = _request()
    rows = np.ones((600, 32), np.float32)  # big enough for the cut-out path
    body = wire.generate_request_bytes(header, [rows], dtype)
    embeds = inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(dtype=dtype, shape=[600, 32], data=rows.tobytes()))
    complete = inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(
        completion=inference_pb2.CompletionParams(model="m", prompt_embeds=[embeds]))).SerializeToString()
    parse_complete = InferenceServicer.request_parsers["Generate"]
    assert set(wire.parse_generate_request(body).views) == {"segments[0].embeds"}
    assert isinstance(parse_complete(complete), Received)
    monkeypatch.setenv(fastpath.ENV, "off")
    plain = wire.parse_generate_request(body)
    assert not plain.views and plain.message.segments[0].embeds.data == rows.tobytes()
    assert isinstance(parse_complete(complete), inference_pb2.GenerateRequest)


def test_off_grpc_keeps_its_own_defaults() -> None:
    env = {fastpath.ENV: "off"}
    assert grpc_runtime.apply(env) is False
    assert "GRPC_EXPERIMENTS" not in env


def test_off_the_encoder_cache_uses_redis_py_for_bulk_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedmesh.services.encoder_cache.redis_tier import RedisTier

    async def pools() -> tuple[object, object]:
        fast = RedisTier("redis://127.0.0.1:1/0", mesh_token="t")
        monkeypatch.setenv(fastpath.ENV, "off")
        slow = RedisTier("redis://127.0.0.1:1/0", mesh_token="t")
        return fast._pool, slow._pool

    fast, slow = asyncio.run(pools())
    assert fast is not None and slow is None

"""``transport.wire``: request bytes written field by field parse as exactly the message protobuf's constructors build
(token and embeddings segments, every wire dtype, big and empty tensors), and the rows are copied once."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.transport import wire
from embedmesh.core.transport.received import Received
from embedmesh.services.preprocessor.servicer import InferenceServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2


def _reference(header: worker_pb2.GenerateRequest, pieces: list, dtype: int) -> worker_pb2.GenerateRequest:
    ref = worker_pb2.GenerateRequest()
    ref.CopyFrom(header)
    for p in pieces:
        if isinstance(p, tuple):
            ref.segments.add(token_ids=worker_pb2.TokenIds(ids=p))
        else:
            ref.segments.add(embeds=tensors.from_numpy(p, dtype))
    return ref


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, 2**31, 2**63 - 1])
def test_varint_matches_protobuf(n: int) -> None:
    from google.protobuf.internal import encoder

    assert wire.varint(n) == encoder._VarintBytes(n)


@pytest.mark.parametrize("dtype,np_dtype", [(tensor_pb2.DATA_TYPE_FP32, np.float32),
                                            (tensor_pb2.DATA_TYPE_FP16, np.float16),
                                            (tensor_pb2.DATA_TYPE_BF16, np.uint16),
                                            (tensor_pb2.DATA_TYPE_FP64, np.float64)])
def test_bytes_parse_as_the_constructed_message(dtype: int, np_dtype: type) -> None:
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((37, 24)) * 100).astype(np_dtype)
    pieces = [(1, 2, 300, 70000), rows, (5,), rows[:1]]
    header = worker_pb2.GenerateRequest(request_id="r-1", lora_adapter="sql",
                                        sampling=common_pb2.SamplingParams(max_tokens=7, temperature=0.5))
    body = wire.generate_request_bytes(header, pieces, dtype)
    got = worker_pb2.GenerateRequest.FromString(body)
    assert got == _reference(header, pieces, dtype)
    back, got_dtype = tensors.to_numpy(got.segments[1].embeds)
    assert got_dtype == dtype and np.array_equal(back, rows)


def test_a_big_tensor_and_a_cast_from_another_dtype() -> None:
    rows = np.random.default_rng(1).standard_normal((3000, 576)).astype(np.float64)  # > 2**21 bytes: 4-byte lengths
    header = worker_pb2.GenerateRequest(request_id="big")
    body = wire.generate_request_bytes(header, [rows], tensor_pb2.DATA_TYPE_FP32)
    got = worker_pb2.GenerateRequest.FromString(body)
    assert got == _reference(header, [rows], tensor_pb2.DATA_TYPE_FP32)
    assert np.array_equal(tensors.to_numpy(got.segments[0].embeds)[0], rows.astype(np.float32))


def test_non_contiguous_rows_are_sent_in_order() -> None:
    rows = np.arange(2 * 8 * 6, dtype=np.float32).reshape(2, 8, 6)[:, ::2, :].reshape(8, 6)[::2]
    got = worker_pb2.GenerateRequest.FromString(
        wire.generate_request_bytes(worker_pb2.GenerateRequest(request_id="x"), [rows], tensor_pb2.DATA_TYPE_FP32))
    assert np.array_equal(tensors.to_numpy(got.segments[0].embeds)[0], rows)


def test_header_with_segments_is_refused() -> None:
    with pytest.raises(ValueError):
        wire.generate_request_bytes(worker_pb2.GenerateRequest(segments=[worker_pb2.PromptSegment()]), [],
                                    tensor_pb2.DATA_TYPE_FP32)


def test_rows_are_copied_once() -> None:
    rows = np.random.default_rng(2).standard_normal((4096, 512)).astype(np.float32)  # 8 MiB
    header = worker_pb2.GenerateRequest(request_id="m")
    tracemalloc.start()
    try:
        body = wire.generate_request_bytes(header, [rows], tensor_pb2.DATA_TYPE_FP32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body) > rows.nbytes
    assert peak < rows.nbytes * 1.1, f"peak {peak} for {rows.nbytes} bytes of rows: more than one copy"


def _body(pieces: list, dtype: int = tensor_pb2.DATA_TYPE_FP32) -> tuple[bytes, worker_pb2.GenerateRequest]:
    header = worker_pb2.GenerateRequest(request_id="z", sampling=common_pb2.SamplingParams(max_tokens=3))
    return wire.generate_request_bytes(header, pieces, dtype), _reference(header, pieces, dtype)


def test_received_tensors_become_views_of_the_request_bytes() -> None:
    a = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float32)
    b = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    raw, ref = _body([(1, 2), a, b, (7,)])
    split = wire.split_generate_request(raw)
    assert split is not None
    assert set(split.views) == {"segments[1].embeds", "segments[2].embeds"}
    # Everything but the cut-out bytes is the message protobuf parses; the bytes are the rows, not copies.
    expected = worker_pb2.GenerateRequest()
    expected.CopyFrom(ref)
    expected.segments[1].embeds.data = b""
    expected.segments[2].embeds.data = b""
    assert split.message == expected
    assert bytes(split.views["segments[1].embeds"]) == a.tobytes()
    assert split.views["segments[1].embeds"].obj is raw
    got, _ = split.tensor("segments[2].embeds", split.message.segments[2].embeds).read("segments[2].embeds")
    assert np.array_equal(got, b)
    # A tensor that carries its own bytes is read from the message as before.
    other = tensors.from_numpy(a)
    assert np.array_equal(split.tensor("segments[2].embeds", other).read("segments[2].embeds")[0], a)


def test_odd_shapes_are_left_to_protobuf() -> None:
    rows = np.ones((40, 64), np.float32)
    seg = worker_pb2.PromptSegment(embeds=tensors.from_numpy(rows)).SerializeToString()
    key = wire.varint((2 << 3) | 2) if worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["segments"].number == 2 \
        else None
    assert key is not None
    tensor = tensors.from_numpy(rows).SerializeToString()
    embeds_key = wire.varint((worker_pb2.PromptSegment.DESCRIPTOR.fields_by_name["embeds"].number << 3) | 2)
    twice = embeds_key + wire.varint(len(tensor)) + tensor
    doubled = key + wire.varint(len(twice) * 2) + twice + twice  # embeds twice in one segment: protobuf merges
    assert wire.split_generate_request(doubled) is None
    mixed = worker_pb2.PromptSegment()
    mixed.embeds.CopyFrom(tensors.from_numpy(rows))
    token_after = mixed.SerializeToString() + worker_pb2.PromptSegment(
        token_ids=worker_pb2.TokenIds(ids=[1])).SerializeToString()  # the oneof's last member wins
    assert wire.split_generate_request(key + wire.varint(len(token_after)) + token_after) is None
    assert wire.split_generate_request(b"\xff\xff\xff") is None  # malformed: protobuf words the error
    assert wire.split_generate_request(key + wire.varint(len(seg) + 10) + seg) is None  # truncated
    parsed = wire.parse_generate_request(doubled)
    assert not parsed.views and len(parsed.message.segments) == 1


def test_small_requests_parse_as_usual() -> None:
    raw, ref = _body([(1, 2, 3)])
    parsed = wire.parse_generate_request(raw)
    assert parsed.message == ref and not parsed.views


_PARSE = InferenceServicer.request_parsers["Generate"]
"""The preprocessor's parser of Generate's messages (what ``Server.add`` installs for it)."""


def _header(params: Any, stream: bool = False) -> Any:
    from embedmesh.inference.v1 import inference_pb2

    return inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(completion=params, stream=stream))


def test_completion_headers_keep_raw_tensors_as_views_under_the_preprocessors_field_names() -> None:
    from embedmesh.inference.v1 import inference_pb2

    a = np.random.default_rng(5).standard_normal((30, 64)).astype(np.float32)
    b = np.random.default_rng(6).standard_normal((20, 64)).astype(np.float16)
    for stream in (False, True):
        req = _header(inference_pb2.CompletionParams(model="m", prompts=["x"], prompt_embeds=[
            inference_pb2.PromptEmbeds(tensor=tensors.from_numpy(a)),
            inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=b"PK\x03\x04zz")),
            inference_pb2.PromptEmbeds(tensor=tensors.from_numpy(b))]), stream)
        req.request.completion.sampling.max_tokens = 4
        raw = req.SerializeToString()
        split = _PARSE(raw)
        assert isinstance(split, Received)
        assert set(split.views) == {"prompt_embeds[0]", "prompt_embeds[1]", "prompt_embeds[2]"}
        assert bytes(split.views["prompt_embeds[1]"]) == b"PK\x03\x04zz"
        expected = inference_pb2.GenerateRequest()
        expected.CopyFrom(req)
        expected.request.completion.prompt_embeds[0].tensor.data = b""
        expected.request.completion.prompt_embeds[1].encoded.data = b""
        expected.request.completion.prompt_embeds[2].tensor.data = b""
        assert split.message == expected and split.message.request.stream == stream
        assert bytes(split.views["prompt_embeds[2]"]) == b.tobytes()
        one = _header(inference_pb2.CompletionParams(
            model="m", prompt_embeds=[inference_pb2.PromptEmbeds(tensor=tensors.from_numpy(a))]))
        single = wire.split_generate_header(one.SerializeToString())
        assert single is not None and list(single.views) == ["prompt_embeds"]
        # the header twice (protobuf merges them): left to protobuf.
        twice = one.SerializeToString() * 2
        assert wire.split_generate_header(twice) is None
        parsed = _PARSE(twice)
        assert isinstance(parsed, inference_pb2.GenerateRequest)
        assert len(parsed.request.completion.prompt_embeds) == 2


def test_other_generate_messages_parse_as_usual() -> None:
    from embedmesh.inference.v1 import inference_pb2

    blob = bytes(range(256)) * 40
    chat = inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(chat=inference_pb2.ChatParams(
        model="m", messages=[inference_pb2.ChatMessage(role="user", parts=[inference_pb2.ChatContentPart(
            prompt_embeds=inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=blob)))])])))
    parsed = _PARSE(chat.SerializeToString())
    assert parsed == chat
    rows = inference_pb2.GenerateRequest(rows=blob).SerializeToString()
    piece = _PARSE(rows)
    assert isinstance(piece, wire.RowsPiece) and bytes(piece.data) == blob
    small = _header(inference_pb2.CompletionParams(model="m", prompt_embeds=[
        inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=b"tiny"))]))
    assert _PARSE(small.SerializeToString()) == small


def test_serialized_tensors_from_the_gateway_become_views_too() -> None:
    from embedmesh.inference.v1 import inference_pb2

    blob = b"PK\x03\x04" + bytes(range(256)) * 40
    req = _header(inference_pb2.CompletionParams(model="m", prompt_embeds=[
        inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=blob)),
        inference_pb2.PromptEmbeds(cache_id="emb-abc")]), stream=True)
    split = wire.split_generate_header(req.SerializeToString())
    assert split is not None and list(split.views) == ["prompt_embeds[0]"]
    assert bytes(split.views["prompt_embeds[0]"]) == blob
    expected = inference_pb2.GenerateRequest()
    expected.CopyFrom(req)
    expected.request.completion.prompt_embeds[0].encoded.data = b""
    assert split.message == expected
    # Two sources in one entry (a oneof: protobuf keeps the last): left to protobuf.
    both = inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=blob)).SerializeToString() + \
        inference_pb2.PromptEmbeds(cache_id="emb-x").SerializeToString()
    pe_key = wire.varint((inference_pb2.CompletionParams.DESCRIPTOR.fields_by_name["prompt_embeds"].number << 3) | 2)
    params = pe_key + wire.varint(len(both)) + both
    header = wire.varint((1 << 3) | 2) + wire.varint(len(params)) + params
    raw = wire.varint((1 << 3) | 2) + wire.varint(len(header)) + header
    assert wire.split_generate_header(raw) is None
    assert inference_pb2.GenerateRequest.FromString(raw).request.completion.prompt_embeds[0].cache_id == "emb-x"

"""Protobuf <-> engine domain types (``worker/messages.py``): a GenerateRequest becomes a checked
GenerationRequest with every field carried over (ids, rows cast to the model dtype, sampling, adapter), and deltas
and model info go back field for field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams, Structured, sampling_to_proto
from embedmesh.core.transport import pieces
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    FinishReason,
    GenerationDelta,
    ModelInfo,
    TokenLogprob,
    TokenSegment,
)
from embedmesh.services.worker.messages import (
    FINISH_TO_PROTO,
    delta_to_proto,
    info_to_proto,
    logprob_to_proto,
    request_from_proto,
)
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

INFO = ModelInfo("m", "echo", 4, 64, "float32", 100, 8)


def _request(*segments: worker_pb2.PromptSegment, sampling: SamplingParams | None = None,
             **kw: Any) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=kw.pop("request_id", "r1"), segments=list(segments),
                                      sampling=sampling_to_proto(sampling or SamplingParams(max_tokens=3)), **kw)


def _ids(*ids: int) -> worker_pb2.PromptSegment:
    return worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=list(ids)))


def _rows(arr: np.ndarray, dtype: int | None = None) -> worker_pb2.PromptSegment:
    return worker_pb2.PromptSegment(embeds=tensors.from_numpy(arr, dtype))


def test_every_request_field_reaches_the_domain_request() -> None:
    sampling = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.75, top_k=7, seed=11, stop=("x", "yz"),
                              ignore_eos=True, presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=1.25,
                              logit_bias=((3, 1.5), (9, -2.0)), logprobs=2, prompt_logprobs=None,
                              structured=Structured("regex", "a+"), min_tokens=1)
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    req = request_from_proto(_request(_ids(1, 2), _rows(rows), _ids(3), sampling=sampling, lora_adapter="ad"), INFO)
    assert req.request_id == "r1" and req.lora_adapter == "ad"
    assert req.sampling == sampling
    assert [type(s) for s in req.segments] == [TokenSegment, EmbedsSegment, TokenSegment]
    assert req.segments[0] == TokenSegment((1, 2)) and req.segments[2] == TokenSegment((3,))
    got = req.segments[1].rows  # type: ignore[union-attr]
    assert got.dtype == np.float32 and np.array_equal(got, rows)
    assert req.prompt_len == 5


def test_rows_are_cast_to_the_model_dtype() -> None:
    bf16 = ModelInfo("m", "echo", 4, 64, "bfloat16", 100, 8)
    rows = np.full((1, 4), 1.5, np.float32)
    req = request_from_proto(_request(_rows(rows)), bf16)
    seg = req.segments[0]
    assert isinstance(seg, EmbedsSegment) and seg.rows.dtype == np.uint16
    assert np.array_equal(tensors.bf16_to_f32(seg.rows), rows)


@pytest.mark.parametrize(("req", "info", "field", "reason"), [
    (worker_pb2.GenerateRequest(segments=[_ids(1)]), INFO, "request_id", "REQUIRED"),
    (_request(_ids(1)), ModelInfo("e", "hf-embed", 4, 64, "float32", 100, 8, task="embed"), "model", "WRONG_TASK"),
    (_request(_ids(1), sampling=SamplingParams(max_tokens=0)), INFO, "max_tokens", "OUT_OF_RANGE"),
    (_request(worker_pb2.PromptSegment()), INFO, "segments[0]", "EMPTY_SEGMENT"),
    (_request(_ids(1), worker_pb2.PromptSegment()), INFO, "segments[1]", "EMPTY_SEGMENT"),
    (_request(_ids(100)), INFO, "prompt", "TOKEN_OUT_OF_RANGE"),
    (_request(_rows(np.zeros((1, 3), np.float32))), INFO, "prompt_embeds", None),
    (_request(_ids(*range(60)), sampling=SamplingParams(max_tokens=10)), INFO, "max_tokens", "CONTEXT_OVERFLOW"),
])
def test_bad_requests_are_refused_naming_the_field(req: worker_pb2.GenerateRequest, info: ModelInfo, field: str,
                                                   reason: str | None) -> None:
    with pytest.raises(InvalidArgument) as e:
        request_from_proto(req, info)
    assert e.value.field == field
    if reason is not None:
        assert e.value.reason == reason


def _arrived(req: worker_pb2.GenerateRequest, rows: np.ndarray, scan: pieces.Scan | None) -> pieces.Arrival:
    """``req``'s one data-less embeds tensor's arrival (as ``servicer._expect`` makes it), fed ``rows`` and ended."""
    tensor = req.segments[0].embeds
    arrival = pieces.expect(req, lambda _: [("segments[0].embeds", tensor)], 1 << 20, scan)
    assert arrival is not None
    arrival.feed(rows.tobytes())
    arrival.end()
    return arrival


def _dataless(rows: np.ndarray, dtype: int) -> worker_pb2.GenerateRequest:
    return _request(worker_pb2.PromptSegment(embeds=tensor_pb2.Tensor(dtype=dtype, shape=list(rows.shape))))


def test_rows_that_followed_the_request_are_read_from_their_arrival_and_scanned_once() -> None:
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    fp32 = tensor_pb2.DATA_TYPE_FP32
    req = _dataless(rows, fp32)
    arrival = _arrived(req, rows, pieces.finite_scan(fp32, "prompt_embeds"))
    got = request_from_proto(req, INFO, arrival).segments[0]
    assert isinstance(got, EmbedsSegment) and np.array_equal(got.rows, rows)
    assert np.shares_memory(got.rows, arrival.buffers[0][1])  # the arrival's rows, not a copy

    bad = rows.copy()
    bad[1, 2] = np.inf
    # not scanned as they landed: the worker's own check refuses them
    with pytest.raises(InvalidArgument) as e:
        request_from_proto(req, INFO, _arrived(req, bad, None))
    assert (e.value.field, e.value.reason) == ("prompt_embeds", "NON_FINITE")
    # scanned as they landed (here by a scan that lets anything through): not scanned again
    passed = request_from_proto(req, INFO, _arrived(req, bad, lambda i, data: None)).segments[0]
    assert isinstance(passed, EmbedsSegment) and np.isinf(passed.rows[1, 2])

    with pytest.raises(InvalidArgument) as e:  # no arrival: a data-less tensor has no bytes
        request_from_proto(req, INFO)
    assert (e.value.field, e.value.reason) == ("segments[0].embeds.data", "DATA_SIZE_MISMATCH")


def test_max_tokens_zero_is_accepted_for_prompt_logprobs() -> None:
    req = request_from_proto(_request(_ids(1, 2), sampling=SamplingParams(max_tokens=0, prompt_logprobs=1)), INFO)
    assert req.sampling.max_tokens == 0 and req.sampling.prompt_logprobs == 1


def test_a_delta_goes_out_field_for_field() -> None:
    texts = {5: "a", 6: "é", 7: "c"}
    d = GenerationDelta("ab", (5, 6), 2, FinishReason.STOP,
                        logprobs=(TokenLogprob(5, -0.5, ((5, -0.5), (7, -1.5))), TokenLogprob(6, -0.25)),
                        prompt_logprobs=(TokenLogprob(1, None), TokenLogprob(2, -3.0)))
    msg = delta_to_proto(d, 9, lambda t: texts.get(t, "?"))
    assert (msg.text, list(msg.token_ids), msg.finish_reason, msg.prompt_tokens, msg.completion_tokens) == (
        "ab", [5, 6], common_pb2.FINISH_REASON_STOP, 9, 2)
    first = msg.logprobs[0]
    assert (first.token_id, first.token, first.bytes, first.logprob) == (5, "a", b"a", -0.5)
    assert [(t.token_id, t.token, t.logprob, t.bytes) for t in first.top] == [(5, "a", -0.5, b"a"),
                                                                             (7, "c", -1.5, b"c")]
    assert (msg.logprobs[1].token, msg.logprobs[1].bytes) == ("é", "é".encode())
    assert not msg.prompt_logprobs[0].HasField("logprob") and msg.prompt_logprobs[1].logprob == -3.0
    assert [(p.token_id, p.token) for p in msg.prompt_logprobs] == [(1, "?"), (2, "?")]


def test_prompt_tokens_only_on_the_last_delta_and_no_text_without_a_tokenizer() -> None:
    msg = delta_to_proto(GenerationDelta("x", (87,), 1, logprobs=(TokenLogprob(87, -1.0),)), 9)
    assert msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and msg.prompt_tokens == 0
    assert msg.logprobs[0].token == "" and msg.logprobs[0].bytes == b"" and not msg.prompt_logprobs


def test_every_finish_reason_has_its_proto_value() -> None:
    assert {r: FINISH_TO_PROTO[r] for r in FinishReason} == {
        FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH, FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
        FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT}
    for reason, value in FINISH_TO_PROTO.items():
        assert delta_to_proto(GenerationDelta("", (), 0, reason), 1).finish_reason == value


@pytest.mark.parametrize(("info", "task", "dtype"), [
    (ModelInfo("gen", "hf", 576, 8192, "bfloat16", 49152, 8), worker_pb2.MODEL_TASK_GENERATE,
     tensor_pb2.DATA_TYPE_BF16),
    (ModelInfo("emb", "hf-embed", 384, 256, "float16", 30522, 64, task="embed", embedding_size=384,
               supports_dimensions=True), worker_pb2.MODEL_TASK_EMBED, tensor_pb2.DATA_TYPE_FP16),
])
def test_model_info_goes_out_field_for_field(info: ModelInfo, task: int, dtype: int) -> None:
    msg = info_to_proto(info, "w-1")
    assert (msg.model, msg.engine, msg.hidden_size, msg.max_context_tokens, msg.dtype, msg.vocab_size,
            msg.worker_id, msg.max_batch_size, msg.task, msg.embedding_size, msg.supports_dimensions) == (
        info.model, info.engine, info.hidden_size, info.max_context_tokens, dtype, info.vocab_size, "w-1",
        info.max_batch_size, task, info.embedding_size, info.supports_dimensions)


def test_a_logprob_without_a_value_or_tokenizer() -> None:
    out = logprob_to_proto(TokenLogprob(3, None, ((4, -1.0),)), None)
    assert (out.token_id, out.token, out.bytes, out.HasField("logprob")) == (3, "", b"", False)
    assert [(t.token_id, t.token, t.logprob, t.bytes) for t in out.top] == [(4, "", -1.0, b"")]


def test_a_token_text_with_a_lone_surrogate_keeps_its_bytes_and_shows_a_replacement() -> None:
    from embedmesh.services.worker.engines.base import TokenLogprob
    from embedmesh.services.worker.messages import logprob_to_proto

    texts = {5: "a\udcff?", 6: "é"}
    out = logprob_to_proto(TokenLogprob(5, -0.1, ((6, -2.0),)), texts.__getitem__)
    assert out.token == "a\ufffd?" and out.bytes == "a\udcff?".encode("utf-8", "surrogatepass")
    assert out.top[0].token == "é" and out.top[0].bytes == "é".encode()

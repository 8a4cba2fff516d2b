"""Generate pieces streams, whole and streamed, on a real mesh (hf model): prompt_embeds sent in pieces after the
header give exactly what one Generate message gives for the same tensors (several prompts and a prefix, split
anywhere), and a stream that breaks a rule ends with INVALID_ARGUMENT naming the field and the rule, the model's
rules included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import channel_options
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from tests.e2e.conftest import HIDDEN, MAX_EMBEDS_BYTES, MODEL
from tests.support import generate as gen

pytestmark = pytest.mark.e2e

FP32 = tensor_pb2.DATA_TYPE_FP32


def _params(arrays: list[np.ndarray], prefix: np.ndarray | None, with_data: bool) -> inference_pb2.CompletionParams:
    def tensor(a: np.ndarray) -> tensor_pb2.Tensor:
        return tensor_pb2.Tensor(dtype=FP32, shape=list(a.shape), data=a.tobytes() if with_data else b"")

    params = inference_pb2.CompletionParams(
        model=MODEL, prompt_embeds=[inference_pb2.PromptEmbeds(tensor=tensor(a)) for a in arrays])
    if prefix is not None:
        params.prefix.tensor.CopyFrom(tensor(prefix))
    params.sampling.max_tokens = 6
    params.sampling.temperature = 0.0
    return params


def _messages(params: inference_pb2.CompletionParams, data: bytes, size: int) -> Iterator[
        inference_pb2.GenerateRequest]:
    yield gen.header(completion=params)
    for i in range(0, len(data), size):
        yield gen.rows(data[i:i + size])


def test_pieces_give_what_one_message_gives(mesh: Any, embeds_of: Any) -> None:
    a = embeds_of("The capital of France is").numpy().astype(np.float32)
    b = embeds_of("Water boils at").numpy().astype(np.float32)
    pre = embeds_of("Answer briefly.").numpy().astype(np.float32)
    data = a.tobytes() + b.tobytes() + pre.tobytes()  # prompt_embeds in order, then the prefix
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        whole = gen.complete(stub, _params([a, b], pre, True), timeout=120)
        head = _params([a, b], pre, False)
        for size in (1000, 7, len(data)):  # pieces that cut floats, rows and tensors
            got = gen.whole(stub, _messages(head, data, size), timeout=120)
            assert [c.text for c in got.choices] == [c.text for c in whole.choices]
            assert got.usage.prompt_tokens == whole.usage.prompt_tokens == 2 * pre.shape[0] + a.shape[0] + b.shape[0]
        events = list(gen.streamed(stub, _messages(head, data, 4096), timeout=120))
    texts = {0: "", 1: ""}
    for e in events:
        if e.HasField("usage"):
            continue
        texts[e.index] += e.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert events[-1].usage.total_tokens == whole.usage.total_tokens


def _case(case: str) -> list[inference_pb2.GenerateRequest]:
    rows = np.ones((3, HIDDEN), np.float32)
    head = _params([rows], None, False)
    first = gen.header(completion=head)
    data = rows.tobytes()
    if case == "rows first":
        return [gen.rows(data), first]
    if case == "two requests":
        return [first, first]
    if case == "too many bytes":
        return [first, gen.rows(data + b"\0\0\0\0")]
    if case == "too few bytes":
        return [first, gen.rows(data[:-1])]
    if case == "past the cap":
        big = _params([rows], None, False)
        big.prompt_embeds[0].tensor.shape[:] = [MAX_EMBEDS_BYTES // (4 * HIDDEN) + 1, HIDDEN]
        return [gen.header(completion=big)]
    if case == "NaN":
        bad = rows.copy()
        bad[1, 2] = np.nan
        return [first, gen.rows(bad.tobytes())]
    if case == "hidden size":
        odd = _params([np.ones((3, HIDDEN + 1), np.float32)], None, False)
        return [gen.header(completion=odd),
                gen.rows(np.ones((3, HIDDEN + 1), np.float32).tobytes())]
    raise AssertionError(case)


@pytest.mark.parametrize("case, field, reason", [
    ("rows first", "request", "REQUIRED"),
    ("two requests", "request", "DUPLICATE"),
    ("too many bytes", "rows", "TOO_MANY_BYTES"),
    ("too few bytes", "rows", "INCOMPLETE"),
    ("past the cap", "prompt_embeds.shape", "TOO_LARGE"),
    ("NaN", "prompt_embeds", "NON_FINITE"),
    ("hidden size", "prompt_embeds", "HIDDEN_SIZE_MISMATCH"),
])
def test_a_stream_that_breaks_a_rule_is_refused_by_name(mesh: Any, case: str, field: str, reason: str) -> None:
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        for call in (lambda m, **kw: gen.whole(stub, m, **kw), lambda m, **kw: gen.streamed(stub, m, **kw)):
            with pytest.raises(grpc.RpcError) as info:
                call(iter(_case(case)), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            e = from_rpc_error(info.value)
            assert (e.field, e.reason) == (field, reason), info.value.details()


def _chat(parts: list[Any]) -> inference_pb2.ChatParams:
    params = inference_pb2.ChatParams(model=MODEL, messages=[
        inference_pb2.ChatMessage(role="system", parts=[inference_pb2.ChatContentPart(text="Answer briefly.")]),
        inference_pb2.ChatMessage(role="user", parts=parts)])
    params.sampling.max_tokens = 6
    params.sampling.temperature = 0.0
    return params


def test_chat_pieces_give_what_one_chat_message_gives(mesh: Any, embeds_of: Any) -> None:
    a = embeds_of("What is the capital of").numpy().astype(np.float32)
    b = embeds_of("France?").numpy().astype(np.float32)

    def parts(with_data: bool) -> list[Any]:
        def part(x: np.ndarray) -> Any:
            return inference_pb2.ChatContentPart(prompt_embeds=inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(
                dtype=FP32, shape=list(x.shape), data=x.tobytes() if with_data else b"")))
        return [part(a), inference_pb2.ChatContentPart(text=" (one word) "), part(b)]

    data = a.tobytes() + b.tobytes()  # the parts' tensors in message and part order
    head = gen.header(chat=_chat(parts(False)))
    messages = [head] + [gen.rows(data[i:i + 999]) for i in range(0, len(data), 999)]
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        whole = gen.chat(stub, _chat(parts(True)), timeout=120)
        got = gen.whole(stub, iter(messages), timeout=120)
        streamed = "".join(e.text for e in gen.streamed(stub, iter(messages), timeout=120))
        with pytest.raises(grpc.RpcError) as info:
            gen.whole(stub, iter(messages[:-1]), timeout=60)  # the last piece missing
    assert got.choices[0].text == whole.choices[0].text == streamed and got.choices[0].text
    assert got.usage.prompt_tokens == whole.usage.prompt_tokens
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (from_rpc_error(info.value).field, from_rpc_error(info.value).reason) == ("rows", "INCOMPLETE")

"""InferenceService.Generate on a real mesh (hf model): one call for completions and chats, streamed or whole, small
prompts inline and big ones as rows after the header, each giving what the REST API gives for the same request;
a stream that breaks a rule ends with INVALID_ARGUMENT naming the field and the rule; grpcurl drives it with one
``-d``."""

from __future__ import annotations

import base64
import json
import subprocess
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
from tests.e2e.test_grpc_api import grpcurl

pytestmark = pytest.mark.e2e

FP32 = tensor_pb2.DATA_TYPE_FP32
TEXT = "The capital of France is"


def _completion(arrays: list[np.ndarray], with_data: bool, max_tokens: int = 6) -> inference_pb2.CompletionParams:
    params = inference_pb2.CompletionParams(model=MODEL, prompt_embeds=[
        inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(dtype=FP32, shape=list(a.shape),
                                                            data=a.tobytes() if with_data else b""))
        for a in arrays])
    params.sampling.max_tokens = max_tokens
    params.sampling.temperature = 0.0
    return params


def _header(stream: bool, *, completion: Any = None, chat: Any = None) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(completion=completion, chat=chat,
                                                                              stream=stream))


def _pieces(head: inference_pb2.GenerateRequest, data: bytes, size: int) -> Iterator[inference_pb2.GenerateRequest]:
    yield head
    for i in range(0, len(data), size):
        yield inference_pb2.GenerateRequest(rows=data[i:i + size])


def _streamed_text(events: list[inference_pb2.GenerateResponse], kind: str) -> str:
    assert {e.WhichOneof("event") for e in events} == {kind}
    chunks = [getattr(e, kind) for e in events]
    assert sum(1 for c in chunks if c.finish_reason) == 1
    assert chunks[-1].HasField("usage")
    return "".join(c.text for c in chunks)


def test_a_completion_inline_or_in_pieces_streamed_or_whole_gives_the_rest_apis_text(mesh: Any, client: Any,
                                                                                      embeds_of: Any) -> None:
    emb = embeds_of(TEXT).numpy().astype(np.float32)
    expected = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0).choices[0].text
    assert expected
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        whole = list(stub.Generate(iter([_header(False, completion=_completion([emb], True))]), timeout=120))
        assert [e.WhichOneof("event") for e in whole] == ["completion"]
        assert whole[0].completion.choices[0].text == expected
        assert whole[0].completion.usage.prompt_tokens == emb.shape[0]
        streamed = list(stub.Generate(iter([_header(True, completion=_completion([emb], True))]), timeout=120))
        assert _streamed_text(streamed, "completion_chunk") == expected
        for size in (7, 4096):  # pieces that cut floats and rows
            for stream in (False, True):
                events = list(stub.Generate(_pieces(_header(stream, completion=_completion([emb], False)),
                                                    emb.tobytes(), size), timeout=120))
                got = _streamed_text(events, "completion_chunk") if stream else \
                    events[0].completion.choices[0].text
                assert got == expected


def test_a_chat_with_text_and_an_embeddings_part_in_pieces_gives_the_rest_apis_text(mesh: Any, client: Any,
                                                                                     embeds_of: Any) -> None:
    question = embeds_of("What is the capital of France?").numpy().astype(np.float32)

    def chat(with_data: bool) -> inference_pb2.ChatParams:
        params = inference_pb2.ChatParams(model=MODEL, messages=[
            inference_pb2.ChatMessage(role="system", parts=[inference_pb2.ChatContentPart(text="Answer briefly.")]),
            inference_pb2.ChatMessage(role="user", parts=[inference_pb2.ChatContentPart(
                prompt_embeds=inference_pb2.PromptEmbeds(tensor=tensor_pb2.Tensor(
                    dtype=FP32, shape=list(question.shape), data=question.tobytes() if with_data else b"")))])])
        params.sampling.max_tokens = 6
        params.sampling.temperature = 0.0
        return params

    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        whole = list(stub.Generate(iter([_header(False, chat=chat(True))]), timeout=120))
        assert [e.WhichOneof("event") for e in whole] == ["chat"]
        text = whole[0].chat.choices[0].text
        assert text
        streamed = list(stub.Generate(_pieces(_header(True, chat=chat(False)), question.tobytes(), 1000),
                                      timeout=120))
        assert _streamed_text(streamed, "chat_chunk") == text
        # A text-only chat answers what /v1/chat/completions answers.
        plain = inference_pb2.ChatParams(model=MODEL, messages=[inference_pb2.ChatMessage(
            role="user", parts=[inference_pb2.ChatContentPart(text="Say hello.")])])
        plain.sampling.max_tokens = 6
        plain.sampling.temperature = 0.0
        got = list(stub.Generate(iter([_header(False, chat=plain)]), timeout=120))[0].chat.choices[0].text
    rest = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert got == rest.choices[0].message.content


def _case(case: str) -> list[inference_pb2.GenerateRequest]:
    rows = np.ones((3, HIDDEN), np.float32)
    first = _header(False, completion=_completion([rows], False))
    data = rows.tobytes()
    if case == "rows first":
        return [inference_pb2.GenerateRequest(rows=data), first]
    if case == "two headers":
        return [first, first]
    if case == "too many bytes":
        return [first, inference_pb2.GenerateRequest(rows=data + b"\0\0\0\0")]
    if case == "too few bytes":
        return [first, inference_pb2.GenerateRequest(rows=data[:-1])]
    if case == "past the cap":
        big = _completion([rows], False)
        big.prompt_embeds[0].tensor.shape[:] = [MAX_EMBEDS_BYTES // (4 * HIDDEN) + 1, HIDDEN]
        return [_header(False, completion=big)]
    if case == "no task":
        return [inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(stream=True))]
    if case == "empty stream":
        return []
    raise AssertionError(case)


@pytest.mark.parametrize("case, field, reason", [
    ("rows first", "request", "REQUIRED"),
    ("two headers", "request", "DUPLICATE"),
    ("too many bytes", "rows", "TOO_MANY_BYTES"),
    ("too few bytes", "rows", "INCOMPLETE"),
    ("past the cap", "prompt_embeds.shape", "TOO_LARGE"),
    ("no task", "request.task", "REQUIRED"),
    ("empty stream", "request", "REQUIRED"),
])
def test_a_stream_that_breaks_a_rule_is_refused_by_name(mesh: Any, case: str, field: str, reason: str) -> None:
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(iter(_case(case)), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    e = from_rpc_error(info.value)
    assert (e.field, e.reason) == (field, reason), info.value.details()


def test_grpcurl_generates_with_one_message(mesh: Any, client: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT).numpy().astype("<f4")
    body = {"request": {"completion": {
        "model": MODEL, "sampling": {"maxTokens": 6, "temperature": 0},
        "promptEmbeds": [{"tensor": {"dtype": "DATA_TYPE_FP32", "shape": list(emb.shape),
                                     "data": base64.b64encode(emb.tobytes()).decode()}}]}}}
    r = subprocess.run([grpcurl(), "-plaintext", "-d", json.dumps(body), mesh.preprocessor,
                        "embedmesh.inference.v1.InferenceService/Generate"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["completion"]["choices"][0]["text"]
    assert got == client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0).choices[0].text

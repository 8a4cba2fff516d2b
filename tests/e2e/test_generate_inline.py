"""InferenceService.GenerateInline on a real mesh: Generate for a request in one message (a unary request, answered by
Generate's events). Completions and chats, streamed or whole, give what the REST API gives; its request's bytes are a
one-message GenerateRequest's; a broken request is refused with INVALID_ARGUMENT naming the field and the rule, a
tensor without data (rows that would follow the header) is refused pointing at Generate; on a mesh with API keys it
needs one; grpcurl drives it with one ``-d``."""

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
from tests.e2e.conftest import HIDDEN, MODEL
from tests.e2e.test_grpc_api import grpcurl
from tests.support.generate_calls import generate_calls, grew
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

FP32 = tensor_pb2.DATA_TYPE_FP32
TEXT = "The capital of France is"
METHOD = "/embedmesh.inference.v1.InferenceService/GenerateInline"


def _tensor(a: np.ndarray, with_data: bool = True) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=FP32, shape=list(a.shape), data=a.tobytes() if with_data else b"")


def _completion(*, emb: np.ndarray | None = None, prompt: str = "", with_data: bool = True
                ) -> inference_pb2.CompletionParams:
    params = inference_pb2.CompletionParams(model=MODEL)
    if emb is not None:
        params.prompt_embeds.add(tensor=_tensor(emb, with_data))
    if prompt:
        params.prompts.append(prompt)
    params.sampling.max_tokens = 6
    params.sampling.temperature = 0.0
    return params


def _chat(question: np.ndarray | None = None, with_data: bool = True) -> inference_pb2.ChatParams:
    user = inference_pb2.ChatMessage(role="user")
    if question is None:
        user.parts.add(text="Say hello.")
    else:
        user.parts.add(prompt_embeds=inference_pb2.PromptEmbeds(tensor=_tensor(question, with_data)))
    params = inference_pb2.ChatParams(model=MODEL, messages=[
        inference_pb2.ChatMessage(role="system", parts=[inference_pb2.ChatContentPart(text="Answer briefly.")]),
        user])
    params.sampling.max_tokens = 6
    params.sampling.temperature = 0.0
    return params


def _inline(stream: bool, *, completion: Any = None, chat: Any = None) -> inference_pb2.GenerateInlineRequest:
    return inference_pb2.GenerateInlineRequest(request=inference_pb2.GenerateHeader(
        completion=completion, chat=chat, stream=stream))


def _streamed_text(events: list[inference_pb2.GenerateResponse], kind: str) -> str:
    assert {e.WhichOneof("event") for e in events} == {kind}
    chunks = [getattr(e, kind) for e in events]
    assert sum(1 for c in chunks if c.finish_reason) == 1
    assert chunks[-1].HasField("usage")
    return "".join(c.text for c in chunks)


@pytest.fixture
def stub(mesh: Any) -> Iterator[Any]:
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


def test_a_completion_streamed_or_whole_gives_the_rest_apis_text(mesh: Any, client: Any, embeds_of: Any,
                                                                  stub: Any) -> None:
    emb = embeds_of(TEXT).numpy().astype(np.float32)
    assert emb.nbytes >= 4096  # big enough for core.transport.wire to cut its bytes out of the request
    expected = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0).choices[0].text
    assert expected
    before = generate_calls(mesh.extra["metrics_base"] + 1)
    for params in (_completion(emb=emb), _completion(prompt=TEXT)):  # a tensor inline, and a small text prompt
        whole = list(stub.GenerateInline(_inline(False, completion=params), timeout=120))
        assert [e.WhichOneof("event") for e in whole] == ["completion"]
        assert whole[0].completion.choices[0].text == expected
        streamed = list(stub.GenerateInline(_inline(True, completion=params), timeout=120))
        assert _streamed_text(streamed, "completion_chunk") == expected
    assert whole[0].completion.usage.prompt_tokens == emb.shape[0]
    after = generate_calls(mesh.extra["metrics_base"] + 1)
    assert grew(before, after, "completion", False, "message") == 2
    assert grew(before, after, "completion", True, "message") == 2
    assert grew(before, after, "completion", False, "pieces") == 0


def test_a_chat_with_an_embeddings_part_streamed_or_whole_matches_generate_and_rest(
        client: Any, embeds_of: Any, stub: Any) -> None:
    question = embeds_of("What is the capital of France?").numpy().astype(np.float32)
    header = inference_pb2.GenerateRequest(request=inference_pb2.GenerateHeader(chat=_chat(question)))
    by_generate = list(stub.Generate(iter([header]), timeout=120))[0].chat.choices[0].text
    whole = list(stub.GenerateInline(_inline(False, chat=_chat(question)), timeout=120))
    assert [e.WhichOneof("event") for e in whole] == ["chat"]
    assert whole[0].chat.choices[0].text == by_generate and by_generate
    streamed = list(stub.GenerateInline(_inline(True, chat=_chat(question)), timeout=120))
    assert _streamed_text(streamed, "chat_chunk") == by_generate
    plain = list(stub.GenerateInline(_inline(False, chat=_chat()), timeout=120))[0].chat.choices[0].text
    rest = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}])
    assert plain == rest.choices[0].message.content


def test_its_request_bytes_are_a_one_message_generate_requests(mesh: Any, client: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT).numpy().astype(np.float32)
    head = inference_pb2.GenerateHeader(completion=_completion(emb=emb))
    raw = inference_pb2.GenerateRequest(request=head).SerializeToString()
    assert inference_pb2.GenerateInlineRequest(request=head).SerializeToString() == raw
    expected = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0).choices[0].text
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        call = ch.unary_stream(METHOD, request_serializer=None,
                               response_deserializer=inference_pb2.GenerateResponse.FromString)
        events = list(call(raw, timeout=120))
    assert events[0].completion.choices[0].text == expected


def _refused(stub: Any, request: inference_pb2.GenerateInlineRequest) -> Any:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


@pytest.mark.parametrize("case, field, reason", [
    ("no header", "request", "REQUIRED"),
    ("no task", "request.task", "REQUIRED"),
    ("no prompt", "prompt", "MISSING_PROMPT"),
    ("a NaN", "prompt_embeds", "NON_FINITE"),
])
def test_a_broken_request_is_refused_by_name(stub: Any, case: str, field: str, reason: str) -> None:
    rows = np.ones((3, HIDDEN), np.float32)
    if case == "no header":
        request = inference_pb2.GenerateInlineRequest()
    elif case == "no task":
        request = inference_pb2.GenerateInlineRequest(request=inference_pb2.GenerateHeader(stream=True))
    elif case == "no prompt":
        request = _inline(False, completion=inference_pb2.CompletionParams(model=MODEL))
    else:
        rows[1, 2] = np.nan
        request = _inline(True, completion=_completion(emb=rows))
    e = from_rpc_error(_refused(stub, request))
    assert (e.field, e.reason) == (field, reason)


def test_a_tensor_without_data_is_refused_pointing_at_generate(stub: Any) -> None:
    rows = np.ones((3, HIDDEN), np.float32)
    for request, field in (
        (_inline(False, completion=_completion(emb=rows, with_data=False)), "prompt_embeds.data"),
        (_inline(True, chat=_chat(rows, with_data=False)), "messages[1].content[0].data"),
    ):
        error = _refused(stub, request)
        e = from_rpc_error(error)
        assert (e.field, e.reason) == (field, "PIECES_NEED_GENERATE")
        assert "Generate's pieces stream" in error.details()


def test_grpcurl_calls_it_with_one_message(mesh: Any, client: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT).numpy().astype("<f4")
    body = {"request": {"completion": {
        "model": MODEL, "sampling": {"maxTokens": 6, "temperature": 0},
        "promptEmbeds": [{"tensor": {"dtype": "DATA_TYPE_FP32", "shape": list(emb.shape),
                                     "data": base64.b64encode(emb.tobytes()).decode()}}]}}}
    r = subprocess.run([grpcurl(), "-plaintext", "-d", json.dumps(body), mesh.preprocessor,
                        "embedmesh.inference.v1.InferenceService/GenerateInline"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["completion"]["choices"][0]["text"]
    assert got == client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0).choices[0].text


KEY = "sk-inline-0123456789"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "tenant": "inline"}]}))
    m = start_mesh(workers=1, engine="echo", env={"EMBEDMESH_API_KEYS_FILE": str(keys)})
    yield m
    m.stop()


def test_on_a_mesh_with_api_keys_it_needs_one(keyed: Mesh) -> None:
    with grpc.insecure_channel(keyed.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        names = [m.id for m in stub.ListModels(inference_pb2.ListModelsRequest(), timeout=30,
                                               metadata=[("authorization", f"Bearer {KEY}")]).models]
        params = inference_pb2.CompletionParams(model=names[0], prompts=["Hi"])
        params.sampling.max_tokens = 3
        for metadata in ([], [("authorization", "Bearer sk-wrong-0123456789")]):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateInline(_inline(False, completion=params), timeout=30, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
        events = list(stub.GenerateInline(_inline(False, completion=params), timeout=30,
                                          metadata=[("authorization", f"Bearer {KEY}")]))
    assert events[0].completion.usage.completion_tokens == 3

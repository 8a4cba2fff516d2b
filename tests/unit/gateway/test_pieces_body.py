"""A completion with one big torch.save ``prompt_embeds`` payload goes to the preprocessor as a Generate pieces
stream (``gateway/pieces_body.py``): the header carries the tensor's dtype and shape and no data, the pieces carry
exactly the tensor's values; anything else goes as one Generate message; a preprocessor that refuses the declared
size gets the request again as one message, so the client sees what it always saw."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch

from embedmesh.core.errors import InternalError, InvalidArgument, NotFound
from embedmesh.core.transport.thresholds import PIECE_BYTES
from embedmesh.gateway import GatewayConfig
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.pieces_body import GenerateCall, chat_pieces, completion_pieces, fall_back
from embedmesh.gateway.translate import chat_params, completion_params
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from tests.unit.gateway.conftest import MODEL, FakeInference, Harness, rpc_error

MIN = 64 << 10


def saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def rows(n: int = 300, hidden: int = 96, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(n).standard_normal((n, hidden)).astype(np.float32)).to(dtype)


def pieces_of(body: dict[str, Any], min_bytes: int = MIN) -> Any:
    blobs: list[bytes] = []
    params = completion_params(body, blobs)
    return completion_pieces(params, blobs, min_bytes)


def parsed(messages: Iterator[bytes], chat: bool = False) -> tuple[Any, list[bytes]]:
    """The task's params of a Generate pieces stream, and its rows."""
    msgs = [inference_pb2.GenerateRequest.FromString(m) for m in messages]
    assert msgs[0].WhichOneof("part") == "request"
    assert msgs[0].request.WhichOneof("task") == ("chat" if chat else "completion")
    assert all(m.WhichOneof("part") == "rows" for m in msgs[1:])
    return msgs[0].request, [m.rows for m in msgs[1:]]


@pytest.mark.parametrize("dtype, wire_dtype", [(torch.float32, tensor_pb2.DATA_TYPE_FP32),
                                               (torch.float16, tensor_pb2.DATA_TYPE_FP16),
                                               (torch.bfloat16, tensor_pb2.DATA_TYPE_BF16)])
def test_a_big_payload_becomes_its_tensor_then_its_values_in_pieces(dtype: torch.dtype, wire_dtype: int) -> None:
    t = rows(3000, 128, dtype)  # 768 KB or 1.5 MB: one piece or two
    body = {"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(t)), "max_tokens": 5, "temperature": 0.5,
            "n": 2, "stop": ["x"], "seed": 3}
    got = pieces_of(body)
    assert got is not None
    header, pieces = parsed(got.messages())
    request = header.completion
    tensor = request.prompt_embeds[0].tensor
    assert request.prompt_embeds[0].WhichOneof("source") == "tensor" and not header.stream
    assert tensor.dtype == wire_dtype and list(tensor.shape) == [3000, 128] and tensor.data == b""
    assert b"".join(pieces) == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert all(0 < len(p) <= PIECE_BYTES for p in pieces) and len(pieces) == -(-t.nbytes // PIECE_BYTES)
    # everything else of the request is what the one-message path sends
    one = completion_params(body)
    del one.prompt_embeds[:]
    rest = inference_pb2.CompletionParams()
    rest.CopyFrom(request)
    del rest.prompt_embeds[:]
    assert rest == one and rest.sampling.max_tokens == 5 and rest.n == 2


@pytest.mark.parametrize("body", [
    {"prompt_embeds": [b64(saved(rows())), b64(saved(rows()))]},                   # two prompts
    {"prompt_embeds": b64(saved(rows())), "prompt_embeds_prefix": b64(saved(rows(3)))},  # a prefix
    {"prompt_embeds": b64(saved(rows(20)))},                                        # under the size
    {"prompt_embeds": b64(saved(rows().t()))},                                      # a transposed view
    {"prompt_embeds": b64(saved(rows()[::2]))},                                     # rows with gaps
    {"prompt_embeds": b64(saved(torch.arange(40000, dtype=torch.int64).reshape(400, 100)))},  # not floats
    {"prompt_embeds": b64(saved(rows().to(torch.float64)))},                       # a dtype no model has
    {"prompt_embeds": b64(b"PK\x03\x04" + bytes(200_000))},                         # not a readable archive
    {"prompt_embeds": b64(bytes(200_000))},                                         # not an archive at all
    {"prompt_embeds": {"id": "emb-1"}},                                             # an upload id
])
def test_anything_else_goes_as_one_message(body: dict[str, Any]) -> None:
    assert pieces_of({"model": MODEL, "prompt": "", **body}) is None


def test_a_chats_payloads_become_tensors_in_message_and_part_order() -> None:
    a, b = rows(1500, 128), rows(1200, 128, torch.bfloat16)
    body = {"model": MODEL, "max_tokens": 3, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(saved(a))}, {"type": "text", "text": "and"},
                                     {"type": "prompt_embeds", "data": {"id": "emb-1"}}]},
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(saved(b))}]}]}
    blobs: list[bytes] = []
    params = chat_params(body, blobs)
    got = chat_pieces(params, blobs, MIN)
    assert got is not None
    header, pieces = parsed(got.messages(), chat=True)
    parts = [(i, j, p) for i, m in enumerate(header.chat.messages) for j, p in enumerate(m.parts)
             if p.WhichOneof("kind") == "prompt_embeds"]
    sources = [p.prompt_embeds.WhichOneof("source") for _, _, p in parts]
    assert sources == ["tensor", "cache_id", "tensor"]
    assert list(parts[0][2].prompt_embeds.tensor.shape) == [1500, 128]
    assert parts[2][2].prompt_embeds.tensor.dtype == tensor_pb2.DATA_TYPE_BF16
    assert b"".join(pieces) == a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    assert all(len(p) <= PIECE_BYTES for p in pieces)
    # a piece never mixes two tensors: a's pieces end where its bytes end
    sizes = [len(p) for p in pieces]
    assert sum(sizes[:-(-a.nbytes // PIECE_BYTES)]) == a.nbytes
    # one payload that cannot go as pieces keeps the whole chat one message
    body["messages"][2]["content"][0]["data"] = b64(saved(b.t()))
    blobs = []
    assert chat_pieces(chat_params(body, blobs), blobs, MIN) is None
    # nor do small ones
    small = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": b64(saved(rows(20)))}]}]}
    blobs = []
    assert chat_pieces(chat_params(small, blobs), blobs, MIN) is None


def test_zero_turns_the_pieces_off() -> None:
    body = {"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(rows()))}
    assert pieces_of(body, min_bytes=1) is not None
    assert pieces_of(body, min_bytes=0) is None


def test_the_stream_flag_goes_in_the_header() -> None:
    body = {"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(rows()))}
    blobs: list[bytes] = []
    got = completion_pieces(completion_params(body, blobs), blobs, MIN, stream=True)
    assert got is not None and parsed(got.messages())[0].stream


def _size_refused() -> grpc.aio.AioRpcError:
    return rpc_error(InvalidArgument("prompt_embeds.shape: too many", field="prompt_embeds.shape",
                                     reason="TOO_LARGE"))


def test_falls_back_only_for_the_declared_size() -> None:
    assert fall_back(_size_refused())
    assert fall_back(rpc_error(InvalidArgument("messages[1].content[0].shape: too many",
                                               field="messages[1].content[0].shape", reason="TOO_LARGE")))
    # the preprocessor's own answers otherwise stand; gRPC's own errors too (the mesh ships from one version)
    assert not fall_back(rpc_error(InvalidArgument("prompt_embeds: NaN", field="prompt_embeds",
                                                   reason="NON_FINITE")))
    assert not fall_back(rpc_error(InvalidArgument("prompt_embeds: too big", field="prompt_embeds",
                                                   reason="TOO_LARGE")))
    assert not fall_back(rpc_error(NotFound("model: none", field="model", reason="MODEL_NOT_FOUND")))
    assert not fall_back(rpc_error(InternalError("the preprocessor's own failure")))
    assert not fall_back(grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(),
                                              grpc.aio.Metadata(), details="Method not found!"))
    assert not fall_back(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                              details="Internal error from Core"))
    assert not fall_back(grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                              grpc.aio.Metadata(), details="no details: not the mesh's"))


class _Call:
    def __init__(self, outcome: list[Any]) -> None:
        self.outcome = outcome
        self.cancelled = False

    async def read(self) -> Any:
        item = self.outcome.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_generate_call_makes_the_call_again_once_and_only_before_a_response() -> None:
    again: list[_Call] = []

    def make_again(outcome: list[Any]) -> Any:
        def f() -> _Call:
            again.append(_Call(outcome))
            return again[-1]
        return f

    async def run() -> None:
        # whole answer: the fall-back error -> the one-message call's one event
        call = GenerateCall(lambda: _Call([_size_refused()]), make_again(["answer"]))
        assert await call == "answer" and len(again) == 1
        # an answer of the preprocessor's own is the answer
        nan = rpc_error(InvalidArgument("prompt_embeds: NaN", field="prompt_embeds", reason="NON_FINITE"))
        with pytest.raises(grpc.aio.AioRpcError):
            await GenerateCall(lambda: _Call([nan]), make_again(["unused"]))
        assert len(again) == 1
        # a stream that ends without an event is the gateway's 502, not an answer
        with pytest.raises(ApiError) as e:
            await GenerateCall(lambda: _Call([grpc.aio.EOF]))
        assert e.value.status == 502 and e.value.code == "empty_stream"
        # streaming: a fall-back error before the first response -> the one-message call, cancel reaches it
        call = GenerateCall(lambda: _Call([_size_refused()]), make_again(["first", "second"]))
        assert await call.read() == "first" and len(again) == 2
        call.cancel()
        assert again[-1].cancelled
        # after a response, errors are the call's own
        call = GenerateCall(lambda: _Call(["first", _size_refused()]), make_again(["unused"]))
        assert await call.read() == "first"
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        assert len(again) == 2

    asyncio.run(run())


# --- through the gateway ------------------------------------------------------------------------------------------


class _PiecesHarness(Harness):
    async def _start(self) -> None:
        from embedmesh.core.server import Server, ServerOptions

        self.fake = FakeInference()
        self.grpc = Server("fake-preprocessor", ServerOptions(port=0, grace_seconds=0.5))
        self.grpc.add(inference_pb2_grpc.add_InferenceServiceServicer_to_server, self.fake,
                      "embedmesh.inference.v1.InferenceService")
        await self.grpc.start()
        await self.grpc.set_serving(True)
        self.url = await self._serve(GatewayConfig(port=0, preprocessor=self.grpc.address, pieces_min_bytes=MIN,
                                                   request_timeout_seconds=30))


@pytest.fixture(scope="module")
def pgw() -> Iterator[_PiecesHarness]:
    h = _PiecesHarness()
    yield h
    h.close()


def test_a_big_payload_reaches_the_preprocessor_as_pieces(pgw: _PiecesHarness) -> None:
    t = rows(2500, 128)
    body = {"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(t)), "max_tokens": 4}
    r = httpx.post(f"{pgw.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    fake = pgw.fake
    assert r.json()["choices"][0]["text"] == "Hello there"
    sent = fake.last("CompleteChunks")
    assert list(sent.params.prompt_embeds[0].tensor.shape) == [2500, 128] and not sent.header.stream
    assert sent.rows == t.numpy().tobytes() and sent.messages == 1 + -(-t.nbytes // PIECE_BYTES)
    assert not [m for m, _ in fake.requests if m == "Complete"]
    # streamed
    r = httpx.post(f"{pgw.url}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200 and '"text":"Hel"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    sent = fake.last("StreamCompleteChunks")
    assert sent.header.stream and sent.rows == t.numpy().tobytes()
    # under the size: one message, the payload inline (and cut out of the received bytes, then put back by the fake)
    small = rows(100, 128)  # 50 KiB: under MIN
    r = httpx.post(f"{pgw.url}/v1/completions", json={**body, "prompt_embeds": b64(saved(small))}, timeout=30)
    assert r.status_code == 200, r.text
    sent = fake.last("Complete")
    assert sent.messages == 1 and sent.params.prompt_embeds[0].encoded.data == saved(small)


def test_a_big_chat_payload_reaches_the_preprocessor_as_pieces(pgw: _PiecesHarness) -> None:
    t = rows(2500, 128)
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(saved(t))}]}]}
    r = httpx.post(f"{pgw.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello there"
    sent = pgw.fake.last("ChatChunks")
    assert list(sent.params.messages[0].parts[0].prompt_embeds.tensor.shape) == [2500, 128]
    assert sent.rows == t.numpy().tobytes()


def test_a_refused_declared_size_is_asked_again_as_one_message(pgw: _PiecesHarness) -> None:
    fake = pgw.fake
    fake.script.refuse_pieces = InvalidArgument("prompt_embeds.shape: the tensors of this request need 1 bytes or "
                                                "more", field="prompt_embeds.shape", reason="TOO_LARGE")
    fake.script.error = InvalidArgument("prompt_embeds: decoded size 1.2 MiB exceeds the cap", field="prompt_embeds",
                                        reason="TOO_LARGE")
    try:
        t = rows(2500, 128)
        r = httpx.post(f"{pgw.url}/v1/completions",
                       json={"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(t))}, timeout=30)
        calls = list(fake.requests)
    finally:
        fake.reset()
    # the one-message path's words, not the pieces path's
    assert [m for m, _ in calls][-2:] == ["CompleteChunks", "Complete"]  # pieces tried first
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_embeds" and err["code"] == "too_large" and "decoded size" in err["message"]
    assert calls[-1][1].params.prompt_embeds[0].encoded.data == saved(t)

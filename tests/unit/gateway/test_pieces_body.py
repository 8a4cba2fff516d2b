"""A completion with one big torch.save ``prompt_embeds`` payload goes to the preprocessor as a CompleteChunks stream
(``gateway/pieces_body.py``): the request carries the tensor's dtype and shape and no data, the pieces carry exactly
the tensor's values; anything else goes as one message as before; a preprocessor without the methods, or one that
refuses the declared size, gets the request again as one message, so the client sees what it always saw."""

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

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors, wire
from embedmesh.core.errors import InternalError, InvalidArgument, NotFound
from embedmesh.gateway import GatewayConfig
from embedmesh.gateway.pieces_body import PIECE_BYTES, PiecesCall, chat_pieces, completion_pieces, fall_back
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


def parsed(messages: Iterator[bytes], cls: Any = inference_pb2.CompleteChunksRequest) -> tuple[Any, list[bytes]]:
    msgs = [cls.FromString(m) for m in messages]
    assert msgs[0].WhichOneof("part") == "request"
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
    request, pieces = parsed(got.messages())
    tensor = request.params.prompt_embeds[0].tensor
    assert request.params.prompt_embeds[0].WhichOneof("source") == "tensor"
    assert tensor.dtype == wire_dtype and list(tensor.shape) == [3000, 128] and tensor.data == b""
    assert b"".join(pieces) == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert all(0 < len(p) <= PIECE_BYTES for p in pieces) and len(pieces) == -(-t.nbytes // PIECE_BYTES)
    # everything else of the request is what the one-message path sends
    one = completion_params(body)
    del one.prompt_embeds[:]
    rest = inference_pb2.CompletionParams()
    rest.CopyFrom(request.params)
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
    request, pieces = parsed(got.messages(), inference_pb2.ChatChunksRequest)
    parts = [(i, j, p) for i, m in enumerate(request.params.messages) for j, p in enumerate(m.parts)
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


def _unimplemented_from_grpc() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="Method not found!")


def test_falls_back_only_for_a_missing_method_or_the_declared_size() -> None:
    assert fall_back(_unimplemented_from_grpc())
    # grpc.aio's own INTERNAL for a write the ended call failed (it hides the UNIMPLEMENTED that ended it)
    assert fall_back(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                          details="Internal error from Core"))
    assert fall_back(rpc_error(InvalidArgument("prompt_embeds.shape: too many", field="prompt_embeds.shape",
                                               reason="TOO_LARGE")))
    assert fall_back(rpc_error(InvalidArgument("messages[1].content[0].shape: too many",
                                               field="messages[1].content[0].shape", reason="TOO_LARGE")))
    # the preprocessor's own answers otherwise stand
    assert not fall_back(rpc_error(InvalidArgument("prompt_embeds: NaN", field="prompt_embeds",
                                                   reason="NON_FINITE")))
    assert not fall_back(rpc_error(InvalidArgument("prompt_embeds: too big", field="prompt_embeds",
                                                   reason="TOO_LARGE")))
    assert not fall_back(rpc_error(NotFound("model: none", field="model", reason="MODEL_NOT_FOUND")))
    assert not fall_back(rpc_error(InternalError("the preprocessor's own failure")))
    assert not fall_back(grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                              grpc.aio.Metadata(), details="no details: not the mesh's"))


class _Call:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.cancelled = False

    def __await__(self) -> Any:
        async def go() -> Any:
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return go().__await__()

    async def read(self) -> Any:
        item = self.outcome.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_pieces_call_makes_the_call_again_once_and_only_before_a_response() -> None:
    again: list[_Call] = []

    def make_again(outcome: Any) -> Any:
        def f() -> _Call:
            again.append(_Call(outcome))
            return again[-1]
        return f

    async def run() -> None:
        # unary: the fall-back error -> the one-message call's answer
        call = PiecesCall(lambda: _Call(_unimplemented_from_grpc()), make_again("answer"))
        assert await call == "answer" and len(again) == 1
        # an answer of the preprocessor's own is the answer
        nan = rpc_error(InvalidArgument("prompt_embeds: NaN", field="prompt_embeds", reason="NON_FINITE"))
        with pytest.raises(grpc.aio.AioRpcError):
            await PiecesCall(lambda: _Call(nan), make_again("unused"))
        assert len(again) == 1
        # streaming: a fall-back error before the first response -> the one-message call, cancel reaches it
        call = PiecesCall(lambda: _Call([_unimplemented_from_grpc()]), make_again(["first", "second"]))
        assert await call.read() == "first" and len(again) == 2
        call.cancel()
        assert again[-1].cancelled
        # after a response, errors are the call's own
        call = PiecesCall(lambda: _Call(["first", _unimplemented_from_grpc()]), make_again(["unused"]))
        assert await call.read() == "first"
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        assert len(again) == 2

    asyncio.run(run())


# --- through the gateway ------------------------------------------------------------------------------------------


class _OneMessageFake(FakeInference):
    """The fake preprocessor, also keeping the payload bytes a Complete or Chat call carried."""

    def __init__(self) -> None:
        super().__init__()
        self.payloads: list[bytes] = []

    async def Complete(self, request: Any, context: Any) -> Any:  # noqa: N802
        views = tensors.wire_views() or {}  # the server cut the bytes out of the message as views (core.wire)
        self.payloads.append(bytes(views.get("prompt_embeds", b"")))
        return await super().Complete(request, context)

    async def Chat(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.payloads.append(request.params.messages[0].parts[0].prompt_embeds.encoded.data)
        return await super().Chat(request, context)


class _ChunksFake(_OneMessageFake):
    """The fake preprocessor with the pieces methods: records the request and the bytes of every piece."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[tuple[str, inference_pb2.CompleteRequest, bytes]] = []
        self.refuse_size = False

    async def _read(self, method: str, request_iterator: Any) -> inference_pb2.CompleteRequest:
        first: Any = None
        data = bytearray()
        async for m in request_iterator:
            if first is None:
                first = m.request
            else:
                data += bytes(m.data) if isinstance(m, wire.RowsPiece) else m.rows
        self.chunks.append((method, first, bytes(data)))
        if self.refuse_size:
            raise InvalidArgument("prompt_embeds.shape: the tensors of this request need 1 bytes or more",
                                  field="prompt_embeds.shape", reason="TOO_LARGE")
        return first

    async def CompleteChunks(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        first = await self._read("CompleteChunks", request_iterator)
        return _answer(inference_pb2.CompleteResponse, first, "from pieces")

    async def StreamCompleteChunks(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        await self._read("StreamCompleteChunks", request_iterator)
        for item in self.script.stream:
            yield item

    async def ChatChunks(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        first = await self._read("ChatChunks", request_iterator)
        return _answer(inference_pb2.ChatResponse, first, "chat from pieces")


def _answer(response: Any, request: Any, text: str) -> Any:
    """A one-choice answer of the fake's pieces methods."""
    return response(id="chunks", model=request.params.model, choices=[
        inference_pb2.Choice(index=0, text=text, finish_reason=common_pb2.FINISH_REASON_STOP)],
        usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))


def _without_pieces(servicer: Any, server: Any) -> None:
    """Registers the InferenceService without its pieces methods, as a preprocessor from before them serves it:
    calling one is UNIMPLEMENTED from gRPC itself."""

    class _Filter:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
            kept = {k: v for k, v in handlers.items() if "Chunks" not in k}
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, kept),))
            server.add_registered_method_handlers(name, kept)

    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, _Filter())


class _ChunksHarness(Harness):
    def __init__(self, fake: FakeInference) -> None:
        self._given = fake
        super().__init__()

    async def _start(self) -> None:
        from embedmesh.core.server import Server, ServerOptions

        self.fake = self._given
        self.grpc = Server("fake-preprocessor", ServerOptions(port=0, grace_seconds=0.5))
        adder = inference_pb2_grpc.add_InferenceServiceServicer_to_server if isinstance(self.fake, _ChunksFake) \
            else _without_pieces
        self.grpc.add(adder, self.fake, "embedmesh.inference.v1.InferenceService")
        await self.grpc.start()
        await self.grpc.set_serving(True)
        self.url = await self._serve(GatewayConfig(port=0, preprocessor=self.grpc.address, pieces_min_bytes=MIN,
                                                   request_timeout_seconds=30))


@pytest.fixture(scope="module", params=["with pieces methods", "older preprocessor"])
def pgw(request: Any) -> Iterator[_ChunksHarness]:
    h = _ChunksHarness(_ChunksFake() if request.param == "with pieces methods" else _OneMessageFake())
    yield h
    h.close()


def test_a_big_payload_reaches_the_preprocessor_as_pieces_or_as_one_message(pgw: _ChunksHarness) -> None:
    t = rows(2500, 128)
    body = {"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(t)), "max_tokens": 4}
    r = httpx.post(f"{pgw.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    fake = pgw.fake
    if isinstance(fake, _ChunksFake):
        assert r.json()["choices"][0]["text"] == "from pieces"
        method, head, data = fake.chunks[-1]
        assert method == "CompleteChunks" and not [m for m, _ in fake.requests if m == "Complete"]
        assert list(head.params.prompt_embeds[0].tensor.shape) == [2500, 128]
        assert data == t.numpy().tobytes()
        # streamed
        fake.script.stream = [inference_pb2.StreamCompleteResponse(id="c", model=MODEL, index=0, text="hi",
                                                                   finish_reason=common_pb2.FINISH_REASON_STOP)]
        r = httpx.post(f"{pgw.url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert r.status_code == 200 and '"text":"hi"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert fake.chunks[-1][0] == "StreamCompleteChunks" and fake.chunks[-1][2] == t.numpy().tobytes()
    else:  # no such methods: the same request as one Complete message, answered as before, every time
        for _ in range(8):
            r = httpx.post(f"{pgw.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Hello there"
        sent = fake.last("Complete").params.prompt_embeds[0]
        assert isinstance(fake, _OneMessageFake)
        assert sent.WhichOneof("source") == "encoded" and fake.payloads[-1] == saved(t)


def test_a_big_chat_payload_reaches_the_preprocessor_as_pieces_or_as_one_message(pgw: _ChunksHarness) -> None:
    t = rows(2500, 128)
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(saved(t))}]}]}
    r = httpx.post(f"{pgw.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    fake = pgw.fake
    assert isinstance(fake, _OneMessageFake)
    if isinstance(fake, _ChunksFake):
        assert r.json()["choices"][0]["message"]["content"] == "chat from pieces"
        method, head, data = fake.chunks[-1]
        assert method == "ChatChunks" and list(head.params.messages[0].parts[0].prompt_embeds.tensor.shape) == \
            [2500, 128]
        assert data == t.numpy().tobytes()
    else:  # answered as one Chat call every time (gRPC may report the older server's UNIMPLEMENTED as a failed
        # write while pieces are still going out: that falls back too)
        for _ in range(8):
            r = httpx.post(f"{pgw.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "Hello there"
            assert fake.payloads[-1] == saved(t)


@pytest.fixture(scope="module")
def cgw() -> Iterator[_ChunksHarness]:
    h = _ChunksHarness(_ChunksFake())
    yield h
    h.close()


def test_a_refused_declared_size_is_asked_again_as_one_message(cgw: _ChunksHarness) -> None:
    fake = cgw.fake
    assert isinstance(fake, _ChunksFake)
    fake.refuse_size = True
    fake.script.error = InvalidArgument("prompt_embeds: decoded size 1.2 MiB exceeds the cap", field="prompt_embeds",
                                        reason="TOO_LARGE")
    try:
        t = rows(2500, 128)
        r = httpx.post(f"{cgw.url}/v1/completions",
                       json={"model": MODEL, "prompt": "", "prompt_embeds": b64(saved(t))}, timeout=30)
    finally:
        fake.refuse_size = False
        fake.script.error = None
    # the one-message path's words, not the pieces path's
    assert fake.chunks[-1][0] == "CompleteChunks"  # tried first
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_embeds" and err["code"] == "too_large" and "decoded size" in err["message"]
    assert fake.last("Complete").params.prompt_embeds[0].WhichOneof("source") == "encoded"
    assert fake.payloads[-1] == saved(t)

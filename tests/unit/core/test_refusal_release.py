"""A refused call lets go of what its handler held (its request, its locals) when the refusal is sent, not at the
next garbage collection: core/server.py's wrappers keep ``error = obs.failed(e)`` — the exception itself for a domain
error — in their own frame, which its traceback holds (a cycle through every frame the error passed, the request
included). On a live preprocessor, 15 GenerateInline calls of 64 MiB refused (NaN in the last row) left its RSS
1.07 GiB higher; the default message cap is 512 MiB."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.server import Access, Server, ServerOptions
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc

SERVICE = "embedmesh.imageencoder.v1.ImageEncoderService"


class _Holding(imageencoder_pb2_grpc.ImageEncoderServiceServicer):
    """Each call holds 1 MiB in a local (as a handler holds its request's tensors); model "bad" is refused."""

    def __init__(self) -> None:
        self.held: list[weakref.ref[np.ndarray]] = []

    async def Encode(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        big = np.zeros(1 << 20, np.uint8)
        self.held.append(weakref.ref(big))
        if request.model == "bad":
            raise InvalidArgument("model: refused", field="model", reason="BAD_MODEL")
        return imageencoder_pb2.EncodeResponse()


def test_a_refused_call_frees_its_handlers_locals_without_a_garbage_collection() -> None:
    async def run() -> tuple[list[bool], list[bool]]:
        servicer = _Holding()
        server = Server("t", ServerOptions(port=0, grace_seconds=0))
        server.add(imageencoder_pb2_grpc.add_ImageEncoderServiceServicer_to_server, servicer, SERVICE,
                   access=Access.OPEN)
        await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = imageencoder_pb2_grpc.ImageEncoderServiceStub(channel)
                gc.collect()
                gc.disable()
                try:
                    await stub.Encode(imageencoder_pb2.EncodeRequest(model="ok"))
                    for _ in range(3):
                        with pytest.raises(grpc.RpcError):
                            await stub.Encode(imageencoder_pb2.EncodeRequest(model="bad"))
                    await stub.Encode(imageencoder_pb2.EncodeRequest(model="ok"))
                    await asyncio.sleep(0.2)
                    alive = [r() is not None for r in servicer.held]
                finally:
                    gc.enable()
                gc.collect()
                return alive, [r() is not None for r in servicer.held]
        finally:
            await server._server.stop(0)

    alive, after_gc = asyncio.run(run())
    assert after_gc[:4] == [False] * 4  # the control: nothing else keeps them (a collection frees them)
    assert alive[:4] == [False] * 4, alive  # the answered call's, and the first refused calls'


KINDS_SERVICE = "embedmesh.test.Kinds"


class _Kinds:
    """One RPC of each kind; each holds 1 MiB in a local and refuses a request (or first message) b"bad"."""

    def __init__(self) -> None:
        self.held: list[weakref.ref[np.ndarray]] = []

    def _hold(self, request: bytes) -> None:
        big = np.zeros(1 << 20, np.uint8)
        self.held.append(weakref.ref(big))
        if request == b"bad":
            raise InvalidArgument("request: refused", field="request", reason="BAD")

    async def unary_unary(self, request: bytes, context: Any) -> bytes:
        self._hold(request)
        return b"ok"

    async def unary_stream(self, request: bytes, context: Any) -> Any:
        self._hold(request)
        yield b"ok"

    async def stream_unary(self, requests: Any, context: Any) -> bytes:
        async for request in requests:
            self._hold(request)
        return b"ok"

    async def stream_stream(self, requests: Any, context: Any) -> Any:
        async for request in requests:
            self._hold(request)
            yield b"ok"

    def register(self, _servicer: Any, server: Any) -> None:
        same = {"request_deserializer": bytes, "response_serializer": bytes}
        server.add_registered_method_handlers(KINDS_SERVICE, {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(self.unary_unary, **same),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(self.unary_stream, **same),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(self.stream_unary, **same),
            "StreamStream": grpc.stream_stream_rpc_method_handler(self.stream_stream, **same)})


async def _call(channel: grpc.aio.Channel, kind: str, body: bytes) -> None:
    method = f"/{KINDS_SERVICE}/{kind}"
    if kind == "UnaryUnary":
        await channel.unary_unary(method)(body)
    elif kind == "UnaryStream":
        [_ async for _ in channel.unary_stream(method)(body)]
    elif kind == "StreamUnary":
        await channel.stream_unary(method)(iter([body]))
    else:
        [_ async for _ in channel.stream_stream(method)(iter([body]))]


@pytest.mark.parametrize("kind", ["UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"])
def test_every_rpc_kind_frees_a_refused_calls_locals_without_a_garbage_collection(kind: str) -> None:
    async def run() -> tuple[list[bool], list[bool], grpc.StatusCode, str]:
        servicer = _Kinds()
        server = Server("t", ServerOptions(port=0, grace_seconds=0))
        server.add(servicer.register, servicer, KINDS_SERVICE, access=Access.OPEN)
        await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                gc.collect()
                gc.disable()
                try:
                    await _call(channel, kind, b"ok")
                    for _ in range(3):
                        with pytest.raises(grpc.RpcError) as refused:
                            await _call(channel, kind, b"bad")
                    await _call(channel, kind, b"ok")
                    await asyncio.sleep(0.2)
                    alive = [r() is not None for r in servicer.held]
                finally:
                    gc.enable()
                gc.collect()
                error = refused.value
                return alive, [r() is not None for r in servicer.held], error.code(), error.details()
        finally:
            await server._server.stop(0)

    alive, after_gc, code, details = asyncio.run(run())
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "request: refused")  # the refusal still arrives
    assert after_gc[:4] == [False] * 4  # the control
    assert alive[:4] == [False] * 4, alive

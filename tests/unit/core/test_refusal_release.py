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

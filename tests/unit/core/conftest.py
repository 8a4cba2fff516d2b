"""Shared by the core tests that serve over the wire: a worker servicer (and an encoder cache servicer, for a
unary-stream call) that answer with the caller they saw, the process-wide key ring and transport security reset
around each test, and a server factory."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core import auth, tls
from embedmesh.core.auth import Access
from embedmesh.core.server import Server, ServerOptions
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

WORKER = "embedmesh.worker.v1.WorkerService"
CACHE = "embedmesh.cache.v1.EncoderCacheService"


class Echo(worker_pb2_grpc.WorkerServiceServicer):
    """GetInfo answers with the caller's tenant; ClearKvBlocks is the 'admin' call in these tests."""

    async def GetInfo(self, request: Any, context: Any) -> worker_pb2.GetInfoResponse:  # noqa: N802
        p = auth.current_principal()
        return worker_pb2.GetInfoResponse(model=p.tenant, engine="admin" if p.admin else "user")

    async def ClearKvBlocks(self, request: Any, context: Any) -> Any:  # noqa: N802
        return worker_pb2.ClearKvBlocksResponse(cleared=True)

    async def GenerateMany(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802 - a stream-stream call
        async for message in request_iterator:
            for frame in message.frames:
                yield worker_pb2.GenerateManyResponse(results=[
                    worker_pb2.GenerateResult(id=frame.id, response=worker_pb2.GenerateResponse(
                        text=auth.current_principal().tenant)),
                    worker_pb2.GenerateResult(id=frame.id, end=worker_pb2.GenerationEnd())])


class CacheEcho(cache_pb2_grpc.EncoderCacheServiceServicer):
    """Get (a unary-stream call) answers with the caller's tenant as its one chunk."""

    async def Get(self, request: Any, context: Any) -> Any:  # noqa: N802 - a unary-stream call
        yield cache_pb2.GetResponse(chunk=auth.current_principal().tenant.encode())


@pytest.fixture
def keys() -> Iterator[None]:
    auth.configure_keys(auth.keyring_from_values(api_keys="ka-12345678=alpha,kb-12345678=beta",
                                                 admin_keys="adm-12345678"))
    yield
    auth.configure_keys(auth.KeyRing())


@pytest.fixture
def plain_security() -> Iterator[None]:
    tls.configure(tls.Security())
    yield
    tls.configure(tls.Security())


ServeEcho = Callable[..., Awaitable[Server]]


@pytest.fixture
def serve_echo() -> ServeEcho:
    """``await serve_echo(access, methods=None, public=False)``: an ``Echo`` server on a free port (drain it)."""

    async def serve(access: Access, methods: dict[str, Access] | None = None, public: bool = False) -> Server:
        server = Server("test", ServerOptions(port=0, grace_seconds=0.2, public=public))
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Echo(), WORKER, access=access,
                   methods=methods)
        server.add(cache_pb2_grpc.add_EncoderCacheServiceServicer_to_server, CacheEcho(), CACHE, access=access)
        await server.start()
        return server

    return serve

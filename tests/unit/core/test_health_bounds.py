"""``BoundedHealth`` (``core/health_bounds.py``) over real gRPC: a caller with no key is served Check and Watch on a
keyed public port's wrapping, but holds at most ``per_address`` Watch streams, the server at most ``total``; one past
either is RESOURCE_EXHAUSTED at once, and a stream the caller ends gives its slot back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core import health_bounds
from embedmesh.core.health_bounds import BoundedHealth
from embedmesh.core.server import _open_access, _Registrar, server_options

SERVING = health_pb2.HealthCheckResponse.SERVING


async def _serve(checks: BoundedHealth, public: bool) -> tuple[grpc.aio.Server, int]:
    """A real grpc.aio server with ``checks`` registered as a public port registers its health (the mesh's wrapper:
    open access, the message read after the wrapper admits it) or, ``public`` False, as gRPC's own handlers."""
    server = grpc.aio.server(options=server_options(64 << 20))
    if public:
        health_pb2_grpc.add_HealthServicer_to_server(checks, _Registrar(server, _open_access, False,
                                                                        read_after_auth=True))
    else:
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await checks.set("", SERVING)
    return server, port


async def _watch(stub: health_pb2_grpc.HealthStub, service: str = "") -> Any:
    """A Watch call whose first answer arrived (or the error that ended it)."""
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service))
    await call.read()
    return call


async def _released(checks: BoundedHealth, watches: int) -> None:
    async with asyncio.timeout(10):
        while checks.watches != watches:
            await asyncio.sleep(0.01)


@pytest.fixture
async def keyed(keys: None) -> AsyncIterator[None]:
    yield  # a key ring is configured: the calls below carry no key and are still served (health is open)


@pytest.mark.parametrize("public", [True, False])
async def test_watches_per_address_are_bounded_and_given_back(keyed: None, public: bool) -> None:
    checks = BoundedHealth(per_address=3, total=100)
    server, port = await _serve(checks, public)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            held = [await _watch(stub, f"svc-{i}") for i in range(3)]
            assert checks.watching == {"127.0.0.1": 3}
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _watch(stub, "one-more")
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "your address holds 3 health watches" in (info.value.details() or "")
            # Check is not a watch: still answered
            assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == SERVING
            held.pop().cancel()
            await _released(checks, 2)
            held.append(await _watch(stub))
            assert checks.watching == {"127.0.0.1": 3}
            for call in held:
                call.cancel()
            await _released(checks, 0)
            assert checks.watching == {}
    finally:
        await server.stop(0)


async def test_watches_in_all_are_bounded(keyed: None) -> None:
    checks = BoundedHealth(per_address=100, total=2)
    server, port = await _serve(checks, True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            held = [await _watch(stub), await _watch(stub)]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _watch(stub)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this server holds 2 health watches" in (info.value.details() or "")
            for call in held:
                call.cancel()
            await _released(checks, 0)
    finally:
        await server.stop(0)


async def test_a_watch_still_streams_status_changes(keyed: None) -> None:
    checks = BoundedHealth()
    server, port = await _serve(checks, True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            first = await call.read()
            await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            second = await call.read()
            call.cancel()
            assert (first.status, second.status) == (SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
            await _released(checks, 0)
    finally:
        await server.stop(0)


def test_default_bounds() -> None:
    assert BoundedHealth().per_address == health_bounds.WATCHES_PER_ADDRESS == 16
    assert BoundedHealth().total == health_bounds.WATCHES == 1024

"""The shared bootstrap: errors become status codes with details, surprises become INTERNAL without internals,
health follows loading and draining, messages above gRPC's 4 MiB default pass, bytes that are not a protobuf are
INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core.auth import Access
from embedmesh.core.errors import InvalidArgument, NotFound, Unavailable, from_rpc_error
from embedmesh.core.server import Server, ServerOptions, insecure_channel
from embedmesh.core.transport.wire import varint as _varint
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.worker.many import ManyStreams
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.procmem import rss_mib as _rss_mib
from tests.support.worker_generate import worker_generate

from .conftest import WORKER, ServeEcho

INFERENCE = "embedmesh.inference.v1.InferenceService"


class Scripted(worker_pb2_grpc.WorkerServiceServicer):
    """GetInfo raises what the test put in ``self.raise_``; a generation streams two deltas then raises it."""

    raise_: BaseException | None = None

    def __init__(self) -> None:
        self.many = ManyStreams(self.generate, lambda request: None)

    async def GenerateMany(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        async for results in self.many.serve(request_iterator):
            yield results

    async def GetInfo(self, request: Any, context: Any) -> worker_pb2.GetInfoResponse:  # noqa: N802
        if self.raise_:
            raise self.raise_
        return worker_pb2.GetInfoResponse(model="m")

    async def generate(self, request: Any, arrival: Any = None) -> AsyncIterator[worker_pb2.GenerateResponse]:
        yield worker_pb2.GenerateResponse(text="a")
        if self.raise_:
            raise self.raise_
        yield worker_pb2.GenerateResponse(text=request.request_id)


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[Server, Scripted, grpc.aio.Channel]]:
    impl = Scripted()
    server = Server("test", ServerOptions(port=0, grace_seconds=0.5))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, impl, "embedmesh.worker.v1.WorkerService")
    await server.start()
    channel = insecure_channel(server.address)
    yield server, impl, channel
    await channel.close()
    await server.drain()


@pytest.mark.parametrize(
    "error,code,field,reason",
    [
        (InvalidArgument("prompt_embeds: bad", field="prompt_embeds", reason="BAD_SHAPE"),
         grpc.StatusCode.INVALID_ARGUMENT, "prompt_embeds", "BAD_SHAPE"),
        (NotFound("no such id", field="id"), grpc.StatusCode.NOT_FOUND, "id", "NOT_FOUND"),
        (Unavailable("loading"), grpc.StatusCode.UNAVAILABLE, None, "UNAVAILABLE"),
    ],
)
async def test_domain_errors_carry_code_field_and_reason(served: Any, error: Any, code: Any, field: Any,
                                                         reason: str) -> None:
    _, impl, channel = served
    impl.raise_ = error
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    for call in (lambda: stub.GetInfo(worker_pb2.GetInfoRequest()),):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call()
        assert info.value.code() == code
        back = from_rpc_error(info.value)
        assert (back.field, back.reason, back.message) == (field, reason, error.message)
    # Errors raised mid-stream arrive after the deltas already sent.
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for r in worker_generate(stub, worker_pb2.GenerateRequest(request_id="x")):
            got.append(r.text)
    assert got == ["a"]
    assert info.value.code() == code
    impl.raise_ = None


class _OwnParser(worker_pb2_grpc.WorkerServiceServicer):
    """Hands ``Server.add`` its own GetInfo request parser (as ``WorkerServicer.request_parsers`` does)."""

    request_parsers = {"GetInfo": lambda raw: ("own parser", bytes(raw))}

    async def GetInfo(self, request: Any, context: Any) -> worker_pb2.GetInfoResponse:  # noqa: N802
        return worker_pb2.GetInfoResponse(model=repr(request))


async def test_a_service_hands_its_own_request_parsers_to_add() -> None:
    """The parser a servicer names (or ``add``'s ``parsers``) reads its RPC's request bytes instead of protobuf."""
    request = worker_pb2.GetInfoRequest()
    for parsers, want in ((None, repr(("own parser", b""))), ({}, repr(request))):
        server = Server("test", ServerOptions(port=0, grace_seconds=0.1))
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, _OwnParser(), WORKER, parsers=parsers)
        await server.start()
        channel = insecure_channel(server.address)
        try:
            got = await worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(request)
            assert got.model == want
        finally:
            await channel.close()
            await server.drain()


async def test_unexpected_errors_become_internal_without_internals(served: Any) -> None:
    _, impl, channel = served
    impl.raise_ = KeyError("secret-internal-detail")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    impl.raise_ = None
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (info.value.details() or "")
    assert "incident" in (info.value.details() or "")


async def test_health_not_serving_until_set_then_serving(served: Any) -> None:
    server, _, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    name = "embedmesh.worker.v1.WorkerService"
    r = await health.Check(health_pb2.HealthCheckRequest(service=name))
    assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await server.set_serving(True)
    for service in ("", name):
        r = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING


async def test_messages_larger_than_grpc_default_pass(served: Any) -> None:
    _, _, channel = served
    big = "x" * (12 * 1024 * 1024)
    got = [r.text async for r in worker_generate(channel, worker_pb2.GenerateRequest(request_id=big))]
    assert got[-1] == big


async def test_drain_flips_health_and_stops() -> None:
    server = Server("drain", ServerOptions(port=0, grace_seconds=0.2))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Scripted(), "embedmesh.worker.v1.WorkerService")
    await server.start()
    await server.set_serving(True)
    seen: list[int] = []

    async def hook() -> None:
        seen.append((await server.health.Check(health_pb2.HealthCheckRequest(service=""), None)).status)

    server.on_drain(hook)
    await server.drain()
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]
    await server.wait_for_termination()


async def test_liveness_name_stays_serving_while_readiness_flips() -> None:
    from embedmesh.core.server import LIVENESS

    server = Server("live", ServerOptions(port=0, grace_seconds=0.1))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Scripted(), "embedmesh.worker.v1.WorkerService")
    await server.start()
    channel = insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for serving in (False, True, False):
        await server.set_serving(serving)
        live = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS))
        ready = await health.Check(health_pb2.HealthCheckRequest(service="embedmesh.worker.v1.WorkerService"))
        assert live.status == health_pb2.HealthCheckResponse.SERVING
        assert (ready.status == health_pb2.HealthCheckResponse.SERVING) == serving
    await channel.close()
    await server.drain()


@pytest.fixture
async def open_server(plain_security: None, serve_echo: ServeEcho) -> AsyncIterator[Server]:
    server = await serve_echo(Access.MESH)
    yield server
    await server.drain()


@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"not a protobuf at all \x80"])
async def test_bytes_that_are_not_a_protobuf_are_invalid_argument(open_server: Server, raw: bytes) -> None:
    async with grpc.aio.insecure_channel(open_server.address) as ch:
        call = ch.unary_unary(f"/{WORKER}/GetInfo", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(raw)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert from_rpc_error(info.value).field == "request"
        # ... and the server keeps serving.
        ok = ch.unary_unary(f"/{WORKER}/GetInfo", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        assert await ok(b"") is not None


@pytest.mark.parametrize(("value", "loop_module"), [("", "uvloop"), ("auto", "uvloop"), ("uvloop", "uvloop"),
                                                   ("asyncio", "asyncio")])
def test_services_run_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch, value: str,
                                                      loop_module: str) -> None:
    from embedmesh.core.server import run_service

    monkeypatch.setenv("EMBEDMESH_EVENT_LOOP", value)

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert run_service(which()) == loop_module


def test_an_unknown_event_loop_is_a_usage_error_naming_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedmesh.core.server import run_service

    monkeypatch.setenv("EMBEDMESH_EVENT_LOOP", "trio")

    async def nothing() -> None:
        return None

    coro = nothing()
    with pytest.raises(SystemExit, match="auto, uvloop, asyncio"):
        run_service(coro)
    coro.close()


async def test_a_service_registered_without_its_method_handlers_is_refused() -> None:
    """Only the generated registration hands its handlers over to be wrapped; a registration that adds generic
    handlers alone would be served without authentication or error mapping, so ``add`` refuses it."""

    def register(servicer: Any, server: Any) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("x.Y", {}),))

    server = Server("refuse", ServerOptions(port=0))
    with pytest.raises(TypeError, match="generated add_"):
        server.add(register, object(), "x.Y")


class _Refusing(inference_pb2_grpc.InferenceServiceServicer):
    """Generate (an upload: a header, then rows) refuses the stream after its first message (a rule it breaks)."""

    upload_streams = frozenset({"Generate"})  # as the preprocessor's servicer declares it (Server.add)

    async def Generate(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for _ in request_iterator:
            raise InvalidArgument("request: refused", field="request", reason="REFUSED")
        yield inference_pb2.GenerateResponse()


class _RefusingCache(cache_pb2_grpc.EncoderCacheServiceServicer):
    async def Put(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802 - a stream-unary call
        async for _ in request_iterator:
            raise InvalidArgument("ttl_seconds: refused", field="ttl_seconds", reason="REFUSED")
        return cache_pb2.PutResponse()


async def test_an_upload_refused_early_reaches_a_grpc_aio_client_as_the_refusal() -> None:
    """grpc.aio reports a write that fails because the server already ended the call as its own INTERNAL: a refusal
    of an upload stream is only answered once the client finished sending, so the client sees the refusal."""
    server = Server("test", ServerOptions(port=0, grace_seconds=0.5))
    server.add(inference_pb2_grpc.add_InferenceServiceServicer_to_server, _Refusing(), INFERENCE,
               access=Access.PUBLIC)
    server.add(cache_pb2_grpc.add_EncoderCacheServiceServicer_to_server, _RefusingCache(),
               "embedmesh.cache.v1.EncoderCacheService", access=Access.PUBLIC)
    await server.start()
    channel = insecure_channel(server.address)
    piece = b"\x12" + bytes([0x80, 0x80, 0x40]) + b"\0" * (1 << 20)  # an InferenceService rows message
    chunks = channel.stream_stream(f"/{INFERENCE}/Generate", request_serializer=None, response_deserializer=None)
    cache = cache_pb2_grpc.EncoderCacheServiceStub(channel)
    try:
        for _ in range(10):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in chunks(iter([piece] * 24))]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()

            def puts() -> Any:
                yield cache_pb2.PutRequest(header=cache_pb2.PutHeader())
                for _ in range(24):
                    yield cache_pb2.PutRequest(chunk=b"\0" * (1 << 20))

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cache.Put(puts())
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    finally:
        await channel.close()
        await server.drain()


async def test_an_idle_connection_pinged_as_the_mesh_pings_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every channel and server of the mesh ping idle connections every ``KEEPALIVE_MS``; a server must accept that
    rate. gRPC's server default (one ping without data per 5 minutes, two strikes) answered the mesh's pings with
    GOAWAY ``too_many_pings`` after ~90 s idle, dropping the connection and every long-lived stream on it. Here the
    interval is 1 s instead of 30 (gRPC's clients ping at most once a second), so 6 s idle are the fourth ping that
    a default server refuses."""
    from embedmesh.core import server as server_module

    monkeypatch.setattr(server_module, "KEEPALIVE_MS", 1000)
    srv = Server("keepalive-test", ServerOptions(port=0, grace_seconds=0.1))
    await srv.start()
    await srv.set_serving(True)
    ch = insecure_channel(srv.address)
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert ch.get_state() == grpc.ChannelConnectivity.READY
        await asyncio.sleep(6)  # ~5 pings without data
        assert ch.get_state() == grpc.ChannelConnectivity.READY  # a GOAWAY would have made it IDLE
    finally:
        await ch.close()
        await srv.drain()


_KEYED_SERVER = """
import asyncio, sys
from embedmesh.core import auth
from embedmesh.core.auth import Access
from embedmesh.core.server import Server, ServerOptions
from embedmesh.worker.v1 import worker_pb2_grpc
sys.path.insert(0, sys.argv[1])
from conftest import Echo, WORKER

async def main():
    auth.configure_keys(auth.keyring_from_values(api_keys="ka-12345678=alpha"))
    server = Server("bomb", ServerOptions(port=0, grace_seconds=0.2, public=True))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Echo(), WORKER, access=Access.PUBLIC)
    await server.start()
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_compressed_message_is_refused_before_it_is_inflated_or_the_key_checked() -> None:
    """~130 KB of gzip on the wire, inflating to 128 MiB, sent to a keyed public port with no key: refused at once
    (UNIMPLEMENTED, the compression is named), and the server's memory does not grow by the inflated size — gRPC
    used to inflate and parse the message before the key was looked at."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", _KEYED_SERVER, here], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        opts = [("grpc.max_send_message_length", 512 << 20)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            info_call = ch.unary_unary(f"/{WORKER}/GetInfo", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await info_call(b"")
            assert plain.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the server is up and keyed
            before = _rss_mib(proc.pid)
            payload = b"\xfa\x3f" + _varint(128 << 20) + bytes(128 << 20)  # unknown field 1023: 128 MiB of zeros
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await info_call(payload, compression=grpc.Compression.Gzip)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "ompression" in (info.value.details() or "")
            grown = _rss_mib(proc.pid) - before
            assert grown < 32, f"the server grew by {grown:.0f} MiB for compressed messages it refused"
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await info_call(b"")
            assert again.value.code() == grpc.StatusCode.UNAUTHENTICATED  # and it keeps serving
    finally:
        proc.kill()
        proc.wait()




@pytest.mark.parametrize("public", [True, False])
async def test_every_servers_health_bounds_watch_streams_per_caller(public: bool) -> None:
    """The health service each Server (a public port and a mesh port alike) serves is ``BoundedHealth``: one caller
    address holds at most ``WATCHES_PER_ADDRESS`` Watch streams; one more is refused at once, and a slot comes back
    when a stream ends."""
    from embedmesh.core.health_bounds import WATCHES_PER_ADDRESS

    server = Server("watched", ServerOptions(port=0, grace_seconds=0.2, public=public))
    await server.start()
    await server.set_serving(True)
    channel = insecure_channel(server.address)
    stub = health_pb2_grpc.HealthStub(channel)
    calls = []
    try:
        for _ in range(WATCHES_PER_ADDRESS):
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            first = await call.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            calls.append(call)
        extra = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await extra.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        calls.pop().cancel()
        await asyncio.sleep(0.2)
        again = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
        calls.append(again)
    finally:
        for call in calls:
            call.cancel()
        await channel.close()
        await server.drain()

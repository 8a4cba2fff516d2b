"""core.call_metadata: every call kind on a mesh channel carries the caller's metadata, the trace context, the added
metadata (replacing the caller's entries of those keys) and the mesh token, the same in the same order on the fast
path (metadata put straight into the call, no interceptor) and the plain path (grpc.aio interceptors,
``EMBEDMESH_FASTPATH=off``); a call on the fast path is grpc.aio's own call, not an intercepted one."""

from __future__ import annotations

import contextvars
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider

from embedmesh.core import fastpath, tls
from embedmesh.core.call_metadata import Added, MetadataChannel, with_metadata
from embedmesh.core.server import mesh_channel

_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("test_key", default="")
_FORWARD = Added(lambda: [("authorization", _KEY.get())] if _KEY.get() else [], frozenset({"authorization"}))


def _seen(context: Any) -> bytes:
    """The metadata a call arrived with, gRPC's own entries left out."""
    return json.dumps([[k, v] for k, v in context.invocation_metadata() if k not in ("user-agent",)]).encode()


async def _uu(request: bytes, context: Any) -> bytes:
    return _seen(context)


async def _us(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield _seen(context)


async def _su(requests: Any, context: Any) -> bytes:
    async for _ in requests:
        pass
    return _seen(context)


async def _ss(requests: Any, context: Any) -> AsyncIterator[bytes]:
    async for _ in requests:
        pass
    yield _seen(context)


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {
        "UU": grpc.unary_unary_rpc_method_handler(_uu), "US": grpc.unary_stream_rpc_method_handler(_us),
        "SU": grpc.stream_unary_rpc_method_handler(_su), "SS": grpc.stream_stream_rpc_method_handler(_ss)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
def token() -> Iterator[str]:
    tls.configure(tls.Security(mesh_token="mesh-token-value-123"))
    yield "mesh-token-value-123"
    tls.configure(tls.Security())


async def _every_kind(channel: grpc.aio.Channel, metadata: list[tuple[str, str]]) -> list[list[list[str]]]:
    async def requests() -> AsyncIterator[bytes]:
        yield b"x"

    got = [await channel.unary_unary("/t.S/UU")(b"x", metadata=metadata)]
    got += [m async for m in channel.unary_stream("/t.S/US")(b"x", metadata=metadata)]
    got.append(await channel.stream_unary("/t.S/SU")(requests(), metadata=metadata))
    got += [m async for m in channel.stream_stream("/t.S/SS")(requests(), metadata=metadata)]
    return [json.loads(g) for g in got]


@pytest.mark.parametrize("fast", [True, False])
async def test_every_call_kind_carries_caller_trace_added_and_token_in_order(
        address: str, token: str, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fastpath.ENV, "on" if fast else "off")
    channel = mesh_channel(address, added=[_FORWARD])
    assert isinstance(channel, MetadataChannel) is fast
    tracer = TracerProvider().get_tracer("t")
    try:
        with tracer.start_as_current_span("call") as span:
            set_key = _KEY.set("Bearer client-key-1")
            try:
                got = await _every_kind(channel, [("x-caller", "1"), ("authorization", "Bearer spoofed"),
                                                  (tls.MESH_TOKEN_HEADER, "spoofed-token")])
            finally:
                _KEY.reset(set_key)
        ctx = span.get_span_context()
        for seen in got:
            assert sorted(k for k, _ in seen) == sorted(["x-caller", "traceparent", "authorization",
                                                           tls.MESH_TOKEN_HEADER])  # one of each
            values = dict(seen)
            assert values["x-caller"] == "1"
            assert values["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
            assert values["authorization"] == "Bearer client-key-1"  # the request's key replaces the caller's
            assert values[tls.MESH_TOKEN_HEADER] == token
        # Outside a request and a span: the caller's own authorization stays, the token is still the mesh's.
        bare = await _every_kind(channel, [("authorization", "Bearer own")])
        assert [sorted(map(tuple, seen)) for seen in bare] == [[("authorization", "Bearer own"),
                                                                (tls.MESH_TOKEN_HEADER, token)]] * 4
    finally:
        await channel.close()


async def test_channels_for_outside_clients_never_carry_the_token(address: str, token: str) -> None:
    async with mesh_channel(address, mesh_token=False, added=[_FORWARD]) as channel:
        assert await _every_kind(channel, []) == [[]] * 4


async def test_a_fast_path_call_is_grpcs_own_call_and_the_plain_one_is_intercepted(
        address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpc.aio._interceptor import InterceptedUnaryUnaryCall

    for fast in (True, False):
        monkeypatch.setenv(fastpath.ENV, "on" if fast else "off")
        async with mesh_channel(address, added=[_FORWARD]) as channel:
            call = channel.unary_unary("/t.S/UU")(b"x")
            assert isinstance(call, InterceptedUnaryUnaryCall) is not fast
            assert json.loads(await call) == []
            assert channel.get_state() == grpc.ChannelConnectivity.READY


def test_the_metadata_is_the_callers_then_the_trace_context_then_each_added_in_turn() -> None:
    first = Added(lambda: [("a", "1")], frozenset({"a"}))
    second = Added(lambda: [("b", "2"), ("a", "3")], frozenset({"b"}))
    nothing = Added(lambda: [], frozenset({"keep"}))  # adds nothing: replaces nothing either
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("s"):
        got = with_metadata([("keep", "k"), ("a", "caller"), ("b", "caller")], [first, nothing, second])
    assert [k for k, _ in got] == ["keep", "traceparent", "a", "b", "a"]
    assert [v for k, v in got if k != "traceparent"] == ["k", "1", "2", "3"]
    assert with_metadata(None, []) == []

"""core.mux: entries concatenate into the repeated field protobuf would write; a session writes what is queued,
hands every response message on, and reports how the call ended (clean end, the peer's error, our own close)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from embedmesh.core.mux import MuxSession, entry
from embedmesh.router.v1 import router_pb2
from tests.support.cut_call import CutCall


def test_entries_make_the_repeated_field_protobuf_writes() -> None:
    qs = [router_pb2.RouteQuestion(id=i, request=router_pb2.RouteRequest(model="m" * i)) for i in (1, 2, 300)]
    field = router_pb2.RouteManyRequest.DESCRIPTOR.fields_by_name["questions"].number
    ours = b"".join(entry(field, q.SerializeToString()) for q in qs)
    assert ours == router_pb2.RouteManyRequest(questions=qs).SerializeToString()
    assert list(router_pb2.RouteManyRequest.FromString(ours).questions) == qs


async def _echo_server(behaviour: str) -> tuple[grpc.aio.Server, str, list[bytes]]:
    """A bidi method on raw bytes: ``echo`` answers each message with itself; ``end`` answers the first, then
    ends the call; ``fail`` aborts with RESOURCE_EXHAUSTED on the first message."""
    received: list[bytes] = []

    async def handler(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for message in requests:
            received.append(message)
            if behaviour == "fail":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no")
            yield message
            if behaviour == "end":
                return

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "Bi": grpc.stream_stream_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", received


async def _session(behaviour: str) -> tuple[Any, ...]:
    server, address, received = await _echo_server(behaviour)
    channel = grpc.aio.insecure_channel(address)
    method = channel.stream_stream("/t.T/Bi")
    got: list[bytes] = []
    ended: asyncio.Future[grpc.aio.AioRpcError | None] = asyncio.get_running_loop().create_future()
    session = MuxSession(lambda: method(), got.append, ended.set_result)
    return server, channel, received, got, ended, session


async def test_queued_entries_are_written_and_every_answer_handed_on() -> None:
    server, channel, received, got, ended, session = await _session("echo")
    for i in range(50):
        session.send(bytes([i]))
    async with asyncio.timeout(5):
        while sum(len(m) for m in got) < 50:
            await asyncio.sleep(0.01)
    assert b"".join(got) == bytes(range(50)) == b"".join(received)
    assert len(received) < 50  # what waited while a write was in flight went out together
    assert not session.closed and not ended.done()
    session.close()
    error = await asyncio.wait_for(ended, 5)
    assert error is not None and error.code() == grpc.StatusCode.CANCELLED and session.closed
    await channel.close()
    await server.stop(0)


async def test_a_clean_end_and_a_failure_are_reported_and_close_the_session() -> None:
    for behaviour, code in (("end", None), ("fail", grpc.StatusCode.RESOURCE_EXHAUSTED)):
        server, channel, _, _, ended, session = await _session(behaviour)
        session.send(b"x")
        error = await asyncio.wait_for(ended, 5)
        assert (error.code() if error is not None else None) == code
        assert session.closed
        session.send(b"after")  # a closed session takes no more and raises nothing
        await channel.close()
        await server.stop(0)


async def test_a_stream_that_cannot_be_opened_ends_the_session_at_once() -> None:
    def broken() -> Any:
        raise RuntimeError("channel closed")

    ended: asyncio.Future[grpc.aio.AioRpcError | None] = asyncio.get_running_loop().create_future()
    session = MuxSession(broken, lambda m: None, ended.set_result)
    session.send(b"x")
    error = await asyncio.wait_for(ended, 5)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE and session.closed


async def test_a_write_refused_as_the_peer_ends_the_call_is_reported_as_unavailable_not_internal() -> None:
    from embedmesh.core.mux import CUT_WHILE_WRITING

    ended: asyncio.Future[grpc.aio.AioRpcError | None] = asyncio.get_running_loop().create_future()
    session = MuxSession(CutCall, lambda m: None, ended.set_result)
    session.send(b"x")
    error = await asyncio.wait_for(ended, 5)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == CUT_WHILE_WRITING
    assert session.closed and session.cut_while_writing

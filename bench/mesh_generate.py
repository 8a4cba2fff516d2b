"""The mesh's generation calls as the benches make them on a grpc.aio channel, on message bytes built before timing,
as the bare limits' payloads are: ``one_message`` is ``InferenceService.GenerateInline`` (a header with its tensors
inline: a unary request), ``pieces`` is ``InferenceService.Generate`` (header, then rows, through ``stream_stream``).

A one-message call is made when it is used, the way the mesh's own clients make it: iterated (``async for``), as a
``unary_stream`` call giving each event; given to ``whole``, as a ``unary_unary`` call when under
``thresholds.UNARY_ANSWER_MAX``, since an answer without stream is exactly one event (the same call on the wire: one
message and the status; grpc.aio's unary path costs the client less CPU, as the Python client and the gateway do it
too)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from embedmesh.core.transport.thresholds import UNARY_ANSWER_MAX
from embedmesh.inference.v1 import inference_pb2

__all__ = ["GENERATE", "GENERATE_INLINE", "request_bytes", "one_message", "pieces", "whole", "complete"]

GENERATE = "/embedmesh.inference.v1.InferenceService/Generate"
GENERATE_INLINE = "/embedmesh.inference.v1.InferenceService/GenerateInline"
_EVENT = inference_pb2.GenerateResponse.FromString


def request_bytes(params: Any, *, stream: bool = False, chat: bool = False) -> bytes:
    """A GenerateRequest holding ``params`` (CompletionParams, or ChatParams with ``chat``) as its header: the bytes
    of a GenerateInlineRequest too (the same field)."""
    header = inference_pb2.GenerateHeader(stream=stream)
    (header.chat if chat else header.completion).CopyFrom(params)
    return inference_pb2.GenerateRequest(request=header).SerializeToString()


class _OneMessage:
    """A GenerateInline call of ``data``, made when used (see the module docstring)."""

    __slots__ = ("_calls", "_data", "_kw")

    def __init__(self, calls: tuple[Any, Any], data: bytes, kw: dict[str, Any]) -> None:
        self._calls, self._data, self._kw = calls, data, kw

    def __aiter__(self) -> AsyncIterator[inference_pb2.GenerateResponse]:
        return self._calls[0](self._data, **self._kw).__aiter__()  # type: ignore[no-any-return]

    @property
    def small(self) -> bool:
        return len(self._data) < UNARY_ANSWER_MAX

    async def unary(self) -> inference_pb2.GenerateResponse:
        return await self._calls[1](self._data, **self._kw)  # type: ignore[no-any-return]


def one_message(channel: grpc.aio.Channel) -> Any:
    """GenerateInline for one message of bytes; events as GenerateResponse."""
    calls = (channel.unary_stream(GENERATE_INLINE, request_serializer=None, response_deserializer=_EVENT),
             channel.unary_unary(GENERATE_INLINE, request_serializer=None, response_deserializer=_EVENT))
    return lambda data, **kw: _OneMessage(calls, data, kw)


def pieces(channel: grpc.aio.Channel) -> Any:
    """Generate for a stream of message bytes (header, then rows); events as GenerateResponse."""
    return channel.stream_stream(GENERATE, request_serializer=None, response_deserializer=_EVENT)


async def whole(call: Any) -> Any:
    """The one event of a call without stream, unwrapped (a CompleteResponse or ChatResponse), once the call
    ended."""
    if isinstance(call, _OneMessage) and call.small:
        event = await call.unary()
    else:
        events = [e async for e in call]
        assert len(events) == 1, events
        event = events[0]
    return getattr(event, event.WhichOneof("event"))


async def complete(channel: grpc.aio.Channel, params: Any, **kw: Any) -> Any:
    """One whole completion of ``params`` (the CompleteResponse)."""
    return await whole(one_message(channel)(request_bytes(params), **kw))

"""``InferenceService.Generate`` as the benches call it on a grpc.aio channel: one message (a header with its tensors
inline) through a ``unary_stream`` multicallable, which is the same call on the wire as a client stream of one
message, or a pieces stream (header, then rows) through ``stream_stream``; both take message bytes built before
timing, as the bare limits' payloads are."""

from __future__ import annotations

from typing import Any

import grpc

from embedmesh.inference.v1 import inference_pb2

__all__ = ["GENERATE", "request_bytes", "one_message", "pieces", "whole", "complete"]

GENERATE = "/embedmesh.inference.v1.InferenceService/Generate"


def request_bytes(params: Any, *, stream: bool = False, chat: bool = False) -> bytes:
    """A GenerateRequest holding ``params`` (CompletionParams, or ChatParams with ``chat``) as its header."""
    header = inference_pb2.GenerateHeader(stream=stream)
    (header.chat if chat else header.completion).CopyFrom(params)
    return inference_pb2.GenerateRequest(request=header).SerializeToString()


def one_message(channel: grpc.aio.Channel) -> Any:
    """Generate for one message of bytes; events as GenerateResponse."""
    return channel.unary_stream(GENERATE, request_serializer=None,
                                response_deserializer=inference_pb2.GenerateResponse.FromString)


def pieces(channel: grpc.aio.Channel) -> Any:
    """Generate for a stream of message bytes (header, then rows); events as GenerateResponse."""
    return channel.stream_stream(GENERATE, request_serializer=None,
                                 response_deserializer=inference_pb2.GenerateResponse.FromString)


async def whole(call: Any) -> Any:
    """The one event of a Generate call without stream, unwrapped (a CompleteResponse or ChatResponse), once the
    call ended."""
    events = [e async for e in call]
    assert len(events) == 1, events
    return getattr(events[0], events[0].WhichOneof("event"))


async def complete(channel: grpc.aio.Channel, params: Any, **kw: Any) -> Any:
    """One whole completion of ``params`` (the CompleteResponse)."""
    return await whole(one_message(channel)(request_bytes(params), **kw))

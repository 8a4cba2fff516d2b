"""``InferenceService.Generate`` as the tests call it on a sync stub: a completion or chat, whole or streamed, in one
message (``complete``, ``stream_complete``, ``chat``, ``stream_chat``) or as a pieces stream of ``header`` and
``rows`` messages (``whole``, ``streamed``). Each gives the events' messages unwrapped (a ``CompleteResponse`` /
``ChatResponse``, or the list of ``completion_chunk`` / ``chat_chunk`` messages); a refusal raises the call's
``grpc.RpcError``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from embedmesh.inference.v1 import inference_pb2

__all__ = ["header", "rows", "complete", "stream_complete", "chat", "stream_chat", "whole", "streamed"]


def header(*, completion: Any = None, chat: Any = None, stream: bool = False) -> inference_pb2.GenerateRequest:
    """A Generate stream's first message: the task's params and the stream flag."""
    head = inference_pb2.GenerateHeader(stream=stream)
    (head.chat if chat is not None else head.completion).CopyFrom(chat if chat is not None else completion)
    return inference_pb2.GenerateRequest(request=head)


def rows(data: bytes) -> inference_pb2.GenerateRequest:
    """A Generate stream's ``rows`` message."""
    return inference_pb2.GenerateRequest(rows=data)


def _events(stub: Any, messages: Iterable[inference_pb2.GenerateRequest], **kw: Any) -> list[Any]:
    return [getattr(e, e.WhichOneof("event")) for e in stub.Generate(iter(messages), **kw)]


def _with_stream(messages: Iterable[inference_pb2.GenerateRequest], stream: bool
                 ) -> Iterable[inference_pb2.GenerateRequest]:
    for m in messages:
        if m.WhichOneof("part") == "request" and m.request.stream != stream:
            m = inference_pb2.GenerateRequest.FromString(m.SerializeToString())
            m.request.stream = stream
        yield m


def whole(stub: Any, messages: Iterable[inference_pb2.GenerateRequest], **kw: Any) -> Any:
    """The one event of a Generate call without stream (the header's flag is cleared)."""
    events = _events(stub, _with_stream(messages, False), **kw)
    assert len(events) == 1, events
    return events[0]


def streamed(stub: Any, messages: Iterable[inference_pb2.GenerateRequest], **kw: Any) -> list[Any]:
    """The chunk events of a streamed Generate call (the header's flag is set)."""
    return _events(stub, _with_stream(messages, True), **kw)


def complete(stub: Any, params: inference_pb2.CompletionParams, **kw: Any) -> inference_pb2.CompleteResponse:
    return whole(stub, [header(completion=params)], **kw)


def stream_complete(stub: Any, params: inference_pb2.CompletionParams, **kw: Any) -> list[Any]:
    return streamed(stub, [header(completion=params)], **kw)


def chat(stub: Any, params: inference_pb2.ChatParams, **kw: Any) -> inference_pb2.ChatResponse:
    return whole(stub, [header(chat=params)], **kw)


def stream_chat(stub: Any, params: inference_pb2.ChatParams, **kw: Any) -> list[Any]:
    return streamed(stub, [header(chat=params)], **kw)

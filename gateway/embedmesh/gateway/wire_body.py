"""Wire bytes of a completion or chat request whose ``prompt_embeds`` are big, with one copy of the tensor bytes.

Building the request the usual way copies every decoded ``prompt_embeds`` several times: the ``EncodedTensor``
and ``PromptEmbeds`` constructors, ``params.prompt_embeds.append`` (or ``ChatContentPart(prompt_embeds=...)``),
``CompleteRequest(params=...)`` and ``SerializeToString``. For a 64 MiB tensor that was most of the gateway's
time per request. Here the translation (``completion_params``/``chat_params`` with a ``blobs`` list) leaves a
small placeholder where each decoded tensor goes and collects the bytes in ``blobs``; this module serializes the
small rest with protobuf and splices the blobs in, so one ``b"".join`` is the only copy of them. The bytes parse
as the very ``GenerateRequest`` the constructors would have built (tests/unit/gateway/test_wire_body.py), and are
sent through a multicallable without a request serializer (``generate_call``)::

    blobs: list[bytes] = []
    params = completion_params(body, blobs)
    data = generate_request_bytes(params, blobs, chat=False, stream=True)
    call = generate_call(channel, "unary_stream")(data, timeout=...)    # GenerateInline; events: completion_chunk, ...

Protobuf reads fields in any order, appends repeated ones in the order they come and merges a message field given
more than once; so a repeated field that holds a blob (``prompt_embeds``, ``messages``, ``parts``) is left out of
the serialized rest and written whole after it, in its order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from embedmesh.core import fastpath
from embedmesh.core.transport import thresholds
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["placeholder", "generate_request_bytes", "header_bytes", "plain_request_bytes", "generate_call",
           "inline_call"]

_LEN = 2  # wire type of length-delimited fields

Part = bytes | memoryview


def _number(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


_REQUEST = _number(inference_pb2.GenerateRequest, "request")
_COMPLETION = _number(inference_pb2.GenerateHeader, "completion")
_CHAT = _number(inference_pb2.GenerateHeader, "chat")
_STREAM = bytes([_number(inference_pb2.GenerateHeader, "stream") << 3, 1])  # the flag set: key (varint type), 1
_PROMPT_EMBEDS = _number(inference_pb2.CompletionParams, "prompt_embeds")
_PREFIX = _number(inference_pb2.CompletionParams, "prefix")
_MESSAGES = _number(inference_pb2.ChatParams, "messages")
_PARTS = _number(inference_pb2.ChatMessage, "parts")
_PART_EMBEDS = _number(inference_pb2.ChatContentPart, "prompt_embeds")
_ENCODED = _number(inference_pb2.PromptEmbeds, "encoded")
_DATA = _number(tensor_pb2.EncodedTensor, "data")


def placeholder(index: int) -> bytes:
    """What ``EncodedTensor.data`` holds, in params built with ``blobs``, in place of ``blobs[index]``."""
    return b"%d" % index


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if not n:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _field(number: int, parts: list[Part]) -> list[Part]:
    """A length-delimited field around ``parts``."""
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return [_varint((number << 3) | _LEN) + _varint(size), *parts]


def _embeds(pe: inference_pb2.PromptEmbeds, blobs: Sequence[Part]) -> list[Part]:
    """A PromptEmbeds message's bytes, the blob spliced in when it holds a placeholder."""
    if pe.WhichOneof("source") != "encoded":
        return [pe.SerializeToString()]
    blob = blobs[int(pe.encoded.data)]
    encoded: list[Part] = [tensor_pb2.EncodedTensor(encoding=pe.encoded.encoding).SerializeToString()]
    if len(blob):
        encoded.extend(_field(_DATA, [blob]))
    return _field(_ENCODED, encoded)


def _completion_parts(params: inference_pb2.CompletionParams, blobs: Sequence[Part]) -> list[Part]:
    rest = inference_pb2.CompletionParams()
    rest.CopyFrom(params)
    del rest.prompt_embeds[:]
    rest.ClearField("prefix")
    parts: list[Part] = [rest.SerializeToString()]
    for pe in params.prompt_embeds:
        parts.extend(_field(_PROMPT_EMBEDS, _embeds(pe, blobs)))
    if params.HasField("prefix"):
        parts.extend(_field(_PREFIX, _embeds(params.prefix, blobs)))
    return parts


def _message(msg: inference_pb2.ChatMessage, blobs: Sequence[Part]) -> list[Part]:
    if not any(p.WhichOneof("kind") == "prompt_embeds" for p in msg.parts):
        return [msg.SerializeToString()]
    rest = inference_pb2.ChatMessage()
    rest.CopyFrom(msg)
    del rest.parts[:]
    parts: list[Part] = [rest.SerializeToString()]
    for part in msg.parts:
        if part.WhichOneof("kind") == "prompt_embeds":
            parts.extend(_field(_PARTS, _field(_PART_EMBEDS, _embeds(part.prompt_embeds, blobs))))
        else:
            parts.extend(_field(_PARTS, [part.SerializeToString()]))
    return parts


def _chat_parts(params: inference_pb2.ChatParams, blobs: Sequence[Part]) -> list[Part]:
    rest = inference_pb2.ChatParams()
    rest.CopyFrom(params)
    del rest.messages[:]
    parts: list[Part] = [rest.SerializeToString()]
    for msg in params.messages:
        parts.extend(_field(_MESSAGES, _message(msg, blobs)))
    return parts


def _header(task: list[Part], chat: bool, stream: bool) -> list[Part]:
    """A ``GenerateHeader``'s parts: the task's params (``task``, serialized) and the stream flag."""
    out = _field(_CHAT if chat else _COMPLETION, task)
    if stream:
        out.append(_STREAM)
    return out


def generate_request_bytes(params: inference_pb2.CompletionParams | inference_pb2.ChatParams,
                           blobs: Sequence[Part], *, chat: bool, stream: bool) -> bytes:
    """A ``GenerateRequest`` holding the header of ``params`` (built by ``completion_params(body, blobs)`` or
    ``chat_params(body, blobs)``, as ``chat`` says) with the blobs in place of their placeholders."""
    if not blobs:
        task: list[Part] = [params.SerializeToString()]
    else:
        task = _chat_parts(params, blobs) if chat else _completion_parts(params, blobs)  # type: ignore[arg-type]
    return b"".join(_field(_REQUEST, _header(task, chat, stream)))


def header_bytes(params: inference_pb2.CompletionParams | inference_pb2.ChatParams, *, chat: bool,
                 stream: bool) -> bytes:
    """A ``GenerateHeader`` of ``params`` (no blobs) as bytes, the first message of a pieces stream once wrapped
    (``core.transport.wire.chunk_messages``)."""
    return b"".join(_header([params.SerializeToString()], chat, stream))


def plain_request_bytes(params: inference_pb2.CompletionParams | inference_pb2.ChatParams,
                        blobs: Sequence[Part], *, chat: bool, stream: bool) -> bytes:
    """The same ``GenerateRequest`` as ``generate_request_bytes``, built with protobuf's constructors and
    serializer, each blob copied into its ``EncodedTensor.data`` (the plain path, ``core.fastpath``)."""
    header = inference_pb2.GenerateHeader(stream=stream)
    task = header.chat if chat else header.completion
    task.CopyFrom(params)  # type: ignore[attr-defined]
    if blobs:
        if chat:
            embeds = [p.prompt_embeds for m in task.messages for p in m.parts  # type: ignore[attr-defined]
                      if p.WhichOneof("kind") == "prompt_embeds"]
        else:
            embeds = [*task.prompt_embeds, *([task.prefix] if task.HasField("prefix") else [])]  # type: ignore
        for pe in embeds:
            if pe.WhichOneof("source") == "encoded":
                pe.encoded.data = bytes(blobs[int(pe.encoded.data)])
    return inference_pb2.GenerateRequest(request=header).SerializeToString()


def _event(raw: bytes) -> Any:
    """A ``GenerateResponse``'s event (``completion_chunk``, ``chat_chunk``, ``completion`` or ``chat``): the
    routes read those messages as they are."""
    response = inference_pb2.GenerateResponse.FromString(raw)
    return getattr(response, response.WhichOneof("event"))  # type: ignore[arg-type]


_SERVICE = "/" + inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
_GENERATE = _SERVICE + "/Generate"
_GENERATE_INLINE = _SERVICE + "/GenerateInline"


def generate_call(channel: grpc.aio.Channel, kind: str) -> Any:
    """The generation call taking message bytes as they are (no serializer) and giving each event unwrapped.
    ``kind``: "stream_stream" for a pieces stream (``InferenceService.Generate``), "unary_stream" for one message
    (``InferenceService.GenerateInline``: the same bytes as a one-message Generate stream, served without reading a
    stream; grpc.aio spends less CPU on a unary request on both sides)."""
    method = _GENERATE if kind == "stream_stream" else _GENERATE_INLINE
    return getattr(channel, kind)(method, request_serializer=None, response_deserializer=_event,
                                  _registered_method=True)


def inline_call(channel: grpc.aio.Channel, stream: bool) -> Callable[..., Any]:
    """``InferenceService.GenerateInline`` for one message of bytes, read with ``read()`` (events, then EOF). A
    whole answer (not ``stream``) is exactly one event, so a small one (under ``thresholds.UNARY_ANSWER_MAX``) is
    made as a unary call (the same call on the wire: one message and the status; grpc.aio's unary path costs the
    client less CPU than its streaming one), unless the bypasses are off (``core.fastpath``)."""
    streamed = generate_call(channel, "unary_stream")
    if stream or not fastpath.enabled():
        return streamed  # type: ignore[no-any-return]
    unary = channel.unary_unary(_GENERATE_INLINE, request_serializer=None, response_deserializer=_event,
                                _registered_method=True)
    # read at each call: tests set it to 0 to read every whole answer as a stream
    return lambda data, **kw: (_OneEvent(unary(data, **kw)) if len(data) < thresholds.UNARY_ANSWER_MAX
                               else streamed(data, **kw))


class _OneEvent:
    """A unary call read like a stream of one event."""

    __slots__ = ("_call", "_read")

    def __init__(self, call: Any) -> None:
        self._call = call
        self._read = False

    async def read(self) -> Any:
        if self._read:
            return grpc.aio.EOF
        self._read = True
        return await self._call

    def cancel(self) -> bool:
        return bool(self._call.cancel())

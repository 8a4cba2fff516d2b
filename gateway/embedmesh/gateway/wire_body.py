"""Wire bytes of a completion or chat request whose ``prompt_embeds`` are big, with one copy of the tensor bytes.

Building the request the usual way copies every decoded ``prompt_embeds`` several times: the ``EncodedTensor``
and ``PromptEmbeds`` constructors, ``params.prompt_embeds.append`` (or ``ChatContentPart(prompt_embeds=...)``),
``CompleteRequest(params=...)`` and ``SerializeToString``. For a 64 MiB tensor that was most of the gateway's
time per request. Here the translation (``completion_params``/``chat_params`` with a ``blobs`` list) leaves a
small placeholder where each decoded tensor goes and collects the bytes in ``blobs``; this module serializes the
small rest with protobuf and splices the blobs in, so one ``b"".join`` is the only copy of them. The bytes parse
as the very message the constructors would have built (tests/unit/gateway/test_wire_body.py), and are sent
through a multicallable without a request serializer::

    blobs: list[bytes] = []
    params = completion_params(body, blobs)
    data = completion_request_bytes(params, blobs)   # a CompleteRequest, or a StreamCompleteRequest
    call = raw_unary_unary(channel, "Complete", inference_pb2.CompleteResponse)(data, timeout=...)

Protobuf reads fields in any order, appends repeated ones in the order they come and merges a message field given
more than once; so a repeated field that holds a blob (``prompt_embeds``, ``messages``, ``parts``) is left out of
the serialized rest and written whole after it, in its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

__all__ = [
    "placeholder",
    "completion_request_bytes",
    "chat_request_bytes",
    "raw_unary_unary",
    "raw_unary_stream",
    "raw_call",
]

_LEN = 2  # wire type of length-delimited fields

Part = bytes | memoryview


def _number(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


# Every request message the gateway sends has its params as field 1 (CompleteRequest, StreamCompleteRequest,
# ChatRequest, StreamChatRequest); checked here so a proto change cannot silently break the bytes.
_PARAMS = _number(inference_pb2.CompleteRequest, "params")
for _msg in (inference_pb2.StreamCompleteRequest, inference_pb2.ChatRequest, inference_pb2.StreamChatRequest):
    assert _number(_msg, "params") == _PARAMS
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


def _request(params: list[Part]) -> bytes:
    return b"".join(_field(_PARAMS, params))


def completion_request_bytes(params: inference_pb2.CompletionParams, blobs: Sequence[Part]) -> bytes:
    """A ``CompleteRequest`` (or ``StreamCompleteRequest``: the same bytes) of ``params``, built by
    ``completion_params(body, blobs)``, with the blobs in place of their placeholders."""
    rest = inference_pb2.CompletionParams()
    rest.CopyFrom(params)
    del rest.prompt_embeds[:]
    rest.ClearField("prefix")
    parts: list[Part] = [rest.SerializeToString()]
    for pe in params.prompt_embeds:
        parts.extend(_field(_PROMPT_EMBEDS, _embeds(pe, blobs)))
    if params.HasField("prefix"):
        parts.extend(_field(_PREFIX, _embeds(params.prefix, blobs)))
    return _request(parts)


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


def chat_request_bytes(params: inference_pb2.ChatParams, blobs: Sequence[Part]) -> bytes:
    """A ``ChatRequest`` (or ``StreamChatRequest``: the same bytes) of ``params``, built by
    ``chat_params(body, blobs)``, with the blobs in place of their placeholders."""
    rest = inference_pb2.ChatParams()
    rest.CopyFrom(params)
    del rest.messages[:]
    parts: list[Part] = [rest.SerializeToString()]
    for msg in params.messages:
        parts.extend(_field(_MESSAGES, _message(msg, blobs)))
    return _request(parts)


_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


def raw_call(channel: grpc.aio.Channel, kind: str, method: str, response: Any) -> Any:
    """InferenceService's ``method`` (``kind``: "unary_unary", "unary_stream", "stream_unary" or "stream_stream")
    taking message bytes as they are (no serializer)."""
    return getattr(channel, kind)(f"/{_SERVICE}/{method}", request_serializer=None,
                                  response_deserializer=response.FromString, _registered_method=True)


def raw_unary_unary(channel: grpc.aio.Channel, method: str, response: Any) -> Any:
    """InferenceService's ``method`` taking request bytes as they are (no serializer)."""
    return raw_call(channel, "unary_unary", method, response)


def raw_unary_stream(channel: grpc.aio.Channel, method: str, response: Any) -> Any:
    """InferenceService's streaming ``method`` taking request bytes as they are (no serializer)."""
    return raw_call(channel, "unary_stream", method, response)

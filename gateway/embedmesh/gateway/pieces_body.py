"""The gateway's generation call (``generate``): a request whose decoded ``prompt_embeds`` are big goes as an
``InferenceService.Generate`` pieces stream, the header with each tensor's dtype and shape, then the tensors' values
in 1 MiB pieces, each copied once just before gRPC sends it; any other as one message to
``InferenceService.GenerateInline`` (``wire_body``: the same bytes, a unary request).

Why: sent as one message, a 64 MiB payload is joined into the request bytes, copied again by gRPC, received whole by
the preprocessor before anything starts, hashed for the encoder cache and decoded there. As pieces of raw tensors
(what ``torch.save`` of a float tensor holds), the preprocessor lays them out as they arrive; a completion's one
tensor already in the model's dtype is even checked piece by piece and forwarded to the worker at once
(``transport/pieces.py``, ``InferenceServicer._completion_scan``), so the gateway's send, the preprocessor's checks and
the worker's receive overlap (a chat's tensors are assembled first). The encoder cache is not used for such payloads: a
hit would still cost hashing every byte, as much as the NaN/Inf check it saves.

Taken only when the answer is the same as the one-message path's: a completion with one ``prompt_embeds`` entry and
no prefix, or a chat whose every ``prompt_embeds`` payload qualifies (upload ids stay as they are), with at least
``min_bytes`` of values in all; each payload a ``torch.save`` archive that the mesh's own restricted reader
(``core.tensor_codec.stored_tensor``) accepts and whose values lie in it as a wire tensor's would, in a float dtype.
Everything else — other containers, views, big-endian files, anything the reader refuses — goes as before, and the
preprocessor words the error as it always did. The rules on the values (shape against the model, NaN/Inf, the byte
cap) are the preprocessor's, under the same field names (``prompt_embeds``, ``messages[i].content[j]``); the one
difference in wording, the byte cap (checked on the declared shape, ``<field>.shape``), makes the caller send the
request again as one message (``fall_back``), so the client sees the error the one-message path gives.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from embedmesh.core import fastpath
from embedmesh.core.errors import answered_by_peer, from_rpc_error
from embedmesh.core.tensor_codec import StoredTensor, stored_tensor
from embedmesh.core.transport import wire
from embedmesh.core.transport.thresholds import PIECE_BYTES
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.wire_body import (
    Part,
    generate_call,
    generate_request_bytes,
    header_bytes,
    inline_call,
    plain_request_bytes,
)
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["PiecesBody", "GenerateCall", "completion_pieces", "chat_pieces", "generate", "fall_back"]

_FLOATS = frozenset({tensor_pb2.DATA_TYPE_FP32, tensor_pb2.DATA_TYPE_FP16, tensor_pb2.DATA_TYPE_BF16})


@dataclass(frozen=True)
class PiecesBody:
    """A ``GenerateHeader`` (serialized) whose tensors carry no data, and those tensors' values in order."""

    request: bytes
    values: tuple[memoryview, ...]

    def messages(self) -> Iterator[bytes]:
        """The stream's messages as bytes: the request, then each tensor's values in pieces of ``PIECE_BYTES``,
        each copied once when gRPC asks for it (``core.transport.wire.chunk_messages``: every pieces stream shares
        ``oneof part { request = 1; bytes rows = 2; }``)."""
        return wire.chunk_messages(self.request, self.values, PIECE_BYTES)


def _stored(pe: inference_pb2.PromptEmbeds, blobs: Sequence[bytes | memoryview]) -> StoredTensor | None:
    """The tensor a PromptEmbeds built with ``blobs`` holds, when its values can go as pieces (see the module
    docstring); None otherwise."""
    if pe.WhichOneof("source") != "encoded" or pe.encoded.encoding == tensor_pb2.TENSOR_ENCODING_SAFETENSORS:
        return None
    try:
        blob = blobs[int(pe.encoded.data)]
    except (ValueError, IndexError):
        return None
    try:
        stored = stored_tensor(blob, max_bytes=len(blob), field="prompt_embeds")
    except Exception:  # noqa: BLE001 - refused by the reader: the one-message path gives the preprocessor's words
        return None
    return stored if stored is not None and stored.dtype in _FLOATS else None


def _as_tensor(pe: inference_pb2.PromptEmbeds, stored: StoredTensor) -> None:
    pe.Clear()
    pe.tensor.CopyFrom(tensor_pb2.Tensor(dtype=stored.dtype, shape=list(stored.shape)))


def completion_pieces(params: inference_pb2.CompletionParams, blobs: Sequence[bytes | memoryview],
                      min_bytes: int, *, stream: bool = False) -> PiecesBody | None:
    """``params`` (built with ``blobs``, see ``wire_body``) as a pieces stream, or None when it goes as one
    message: one ``prompt_embeds`` payload of ``min_bytes`` or more, no prefix (see the module docstring)."""
    if min_bytes <= 0 or len(params.prompt_embeds) != 1 or params.HasField("prefix"):
        return None
    stored = _stored(params.prompt_embeds[0], blobs)
    if stored is None or len(stored.data) < min_bytes:
        return None
    head = inference_pb2.CompletionParams()
    head.CopyFrom(params)
    _as_tensor(head.prompt_embeds[0], stored)
    return PiecesBody(header_bytes(head, chat=False, stream=stream), (stored.data,))


def chat_pieces(params: inference_pb2.ChatParams, blobs: Sequence[bytes | memoryview],
                min_bytes: int, *, stream: bool = False) -> PiecesBody | None:
    """``params`` (built with ``blobs``) as a pieces stream, or None when it goes as one message: its
    ``prompt_embeds`` payloads add up to ``min_bytes`` or more and every one of them can go as pieces (upload ids
    stay as they are). The preprocessor assembles a chat's tensors before it runs (no streaming through), so this
    saves the one big message on both sides, not the waiting."""
    if min_bytes <= 0:
        return None
    head = inference_pb2.ChatParams()
    head.CopyFrom(params)
    values: list[memoryview] = []
    for msg in head.messages:
        for part in msg.parts:
            if part.WhichOneof("kind") != "prompt_embeds" or part.prompt_embeds.WhichOneof("source") != "encoded":
                continue
            stored = _stored(part.prompt_embeds, blobs)
            if stored is None:
                return None
            _as_tensor(part.prompt_embeds, stored)
            values.append(stored.data)
    if sum(len(v) for v in values) < min_bytes:
        return None
    return PiecesBody(header_bytes(head, chat=True, stream=stream), tuple(values))


def fall_back(e: grpc.aio.AioRpcError) -> bool:
    """Whether a pieces call's failure means: send the request again as one message. Only when the preprocessor
    refused a tensor's declared size (``<field>.shape``, TOO_LARGE), which the one-message path words under
    ``<field>``; nothing was generated then, and the one-message call gets the preprocessor's own answer."""
    if e.code() != grpc.StatusCode.INVALID_ARGUMENT or not answered_by_peer(e):
        return False
    err = from_rpc_error(e)
    return err.reason == "TOO_LARGE" and (err.field or "").endswith(".shape")


class GenerateCall:
    """A generation call (``first()``), made again as one message (``again()``) when a pieces stream fails before
    any response in a way ``fall_back`` accepts. Awaited for a whole answer (its one event), or read like a
    streaming call; ``cancel`` cancels whichever call is current, so a disconnect watcher can hold it from the
    start."""

    def __init__(self, first: Callable[[], Any], again: Callable[[], Any] | None = None) -> None:
        self._call = first()
        self._again = again

    def cancel(self) -> bool:
        return bool(self._call.cancel())

    def __await__(self) -> Generator[Any, None, Any]:
        return self._response().__await__()

    async def _response(self) -> Any:
        event = await self.read()
        if event is grpc.aio.EOF:
            raise ApiError(502, "the inference service ended the stream without a result", code="empty_stream",
                           type_="server_error")
        return event

    async def read(self) -> Any:
        try:
            item = await self._call.read()
        except grpc.aio.AioRpcError as e:
            if not self._retry(e):
                raise
            item = await self._call.read()
        self._again = None  # a response came: this call is the one
        return item

    def _retry(self, e: grpc.aio.AioRpcError) -> bool:
        if self._again is None or not fall_back(e):
            return False
        self._call, self._again = self._again(), None
        return True


def _one_message(params: Any, blobs: Sequence[Part], chat: bool, stream: bool) -> bytes:
    """The request as one ``GenerateRequest``: decoded payloads spliced in (``wire_body``), or, with the bypasses
    off (``core.fastpath``), built and serialized by protobuf."""
    if fastpath.enabled():
        return generate_request_bytes(params, blobs, chat=chat, stream=stream)
    return plain_request_bytes(params, blobs, chat=chat, stream=stream)


def generate(channel: grpc.aio.Channel, params: inference_pb2.CompletionParams | inference_pb2.ChatParams,
             blobs: Sequence[Part], *, chat: bool, stream: bool, timeout: float, min_bytes: int) -> GenerateCall:
    """The generation of ``params`` (built with ``blobs`` by ``translate``): its events unwrapped
    (``completion_chunk``/``chat_chunk`` messages when ``stream``, else one ``completion``/``chat``). Big payloads
    go as a Generate pieces stream (``min_bytes``, see the module docstring), the rest as one GenerateInline
    message."""
    pieces = None
    if blobs:
        pieces = (chat_pieces if chat else completion_pieces)(params, blobs, min_bytes, stream=stream)  # type: ignore
    if pieces is None:
        data = _one_message(params, blobs, chat, stream)
        return GenerateCall(lambda: inline_call(channel, stream)(data, timeout=timeout))
    messages = pieces.messages()
    return GenerateCall(
        lambda: generate_call(channel, "stream_stream")(messages, timeout=timeout),
        lambda: inline_call(channel, stream)(_one_message(params, blobs, chat, stream), timeout=timeout))

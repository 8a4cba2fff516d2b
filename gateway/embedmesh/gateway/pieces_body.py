"""A completion whose one ``prompt_embeds`` payload is big goes to the preprocessor as a ``CompleteChunks`` stream
(``StreamCompleteChunks`` for ``stream: true``): the request with the tensor's dtype and shape, then its values in
1 MiB pieces, each copied once just before gRPC sends it — instead of one message holding the whole payload.

Why: sent as one message, a 64 MiB payload is joined into the request bytes, copied again by gRPC, received whole by
the preprocessor before anything starts, hashed for the encoder cache and decoded there. As pieces of a raw tensor
already in the model's dtype (what ``torch.save`` of a float tensor holds), the preprocessor checks each piece as it
arrives and forwards it to the worker at once (``core/pieces.py``, ``InferenceServicer._streamed_scan``), so the
gateway's send, the preprocessor's checks and the worker's receive overlap. The encoder cache is not used for such a
payload: a hit would still cost hashing every byte, more than the per-piece check it saves.

Taken only when the answer is the same as the one-message path's: one ``prompt_embeds`` entry and no prefix (the
chat route keeps its one message), a payload of at least ``min_bytes`` whose ``torch.save`` archive the mesh's own
restricted reader (``core.tensor_codec.stored_tensor``) accepts and whose values lie in it as a wire tensor's would,
in a float dtype. Everything else — other containers, views, big-endian files, anything the reader refuses — goes
as before, and the preprocessor words the error as it always did. The rules on the values (shape against the model,
NaN/Inf, the byte cap) are the preprocessor's, under the same field name (``prompt_embeds``); the one difference in
wording, the byte cap (checked on the declared shape, ``prompt_embeds.shape``), makes the caller send the request
again as one message (``fall_back``), so the client sees the error the one-message path gives.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from embedmesh.core.errors import answered_by_peer, from_rpc_error
from embedmesh.core.tensor_codec import stored_tensor
from embedmesh.core.wire import varint
from embedmesh.gateway.wire_body import raw_call
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["PIECE_BYTES", "PiecesBody", "PiecesCall", "completion_pieces", "completion_call", "fall_back"]

PIECE_BYTES = 1 << 20
"""Bytes of tensor values per message."""

_FLOATS = frozenset({tensor_pb2.DATA_TYPE_FP32, tensor_pb2.DATA_TYPE_FP16, tensor_pb2.DATA_TYPE_BF16})
_FIELD = "prompt_embeds"


def _key(message: type, name: str) -> bytes:
    return varint((message.DESCRIPTOR.fields_by_name[name].number << 3) | 2)  # type: ignore[attr-defined]


_REQUEST = _key(inference_pb2.CompleteChunksRequest, "request")
_ROWS = _key(inference_pb2.CompleteChunksRequest, "rows")


@dataclass(frozen=True)
class PiecesBody:
    """A ``CompleteRequest`` (serialized) whose one tensor carries no data, and that tensor's values."""

    request: bytes
    values: memoryview

    def messages(self) -> Iterator[bytes]:
        """The stream's messages as bytes: the request, then the values in pieces of ``PIECE_BYTES``, each copied
        once when gRPC asks for it."""
        yield b"".join((_REQUEST, varint(len(self.request)), self.request))
        values = self.values
        for start in range(0, len(values), PIECE_BYTES):
            piece = values[start:start + PIECE_BYTES]
            yield b"".join((_ROWS, varint(len(piece)), piece))


def completion_pieces(params: inference_pb2.CompletionParams, blobs: Sequence[bytes | memoryview],
                      min_bytes: int) -> PiecesBody | None:
    """``params`` (built with ``blobs``, see ``wire_body``) as a pieces stream, or None when it goes as one message
    (see the module docstring for when)."""
    if min_bytes <= 0 or len(params.prompt_embeds) != 1 or params.HasField("prefix"):
        return None
    pe = params.prompt_embeds[0]
    if pe.WhichOneof("source") != "encoded" or pe.encoded.encoding == tensor_pb2.TENSOR_ENCODING_SAFETENSORS:
        return None
    try:
        blob = blobs[int(pe.encoded.data)]
    except (ValueError, IndexError):
        return None
    if len(blob) < min_bytes:
        return None
    try:
        stored = stored_tensor(blob, max_bytes=len(blob), field=_FIELD)
    except Exception:  # noqa: BLE001 - refused by the reader: the one-message path gives the preprocessor's words
        return None
    if stored is None or stored.dtype not in _FLOATS:
        return None
    head = inference_pb2.CompletionParams()
    head.CopyFrom(params)
    del head.prompt_embeds[:]
    head.prompt_embeds.add().tensor.CopyFrom(tensor_pb2.Tensor(dtype=stored.dtype, shape=list(stored.shape)))
    return PiecesBody(inference_pb2.CompleteRequest(params=head).SerializeToString(), stored.data)


def fall_back(e: grpc.aio.AioRpcError) -> bool:
    """Whether a pieces call's failure means: send the request again as one message. The preprocessor does not
    serve the pieces methods (UNIMPLEMENTED from gRPC itself: an older one), or it refused the tensor's declared
    size (``prompt_embeds.shape``, TOO_LARGE), which the one-message path words under ``prompt_embeds``. Either way
    nothing was generated."""
    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        return not answered_by_peer(e)
    if e.code() != grpc.StatusCode.INVALID_ARGUMENT or not answered_by_peer(e):
        return False
    err = from_rpc_error(e)
    return err.reason == "TOO_LARGE" and err.field == f"{_FIELD}.shape"


class PiecesCall:
    """A call made as a pieces stream (``first()``) and made again as one message (``again()``) when it fails before
    any response in a way ``fall_back`` accepts. Awaited like a unary call or read like a streaming one; ``cancel``
    cancels whichever call is current, so a disconnect watcher can hold it from the start."""

    def __init__(self, first: Callable[[], Any], again: Callable[[], Any]) -> None:
        self._call = first()
        self._again: Callable[[], Any] | None = again

    @property
    def call(self) -> Any:
        return self._call

    def cancel(self) -> bool:
        return bool(self._call.cancel())

    def __await__(self) -> Generator[Any, None, Any]:
        return self._response().__await__()

    async def _response(self) -> Any:
        try:
            return await self._call
        except grpc.aio.AioRpcError as e:
            if not self._retry(e):
                raise
        return await self._call

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


def completion_call(channel: grpc.aio.Channel, pieces: PiecesBody, one_message: Callable[[], bytes],
                    timeout: float, stream: bool) -> PiecesCall:
    """``CompleteChunks`` (``StreamCompleteChunks`` with ``stream``) of ``pieces``, made again as ``Complete``
    (``StreamComplete``) of ``one_message()`` when it falls back."""
    if stream:
        return PiecesCall(
            lambda: raw_call(channel, "stream_stream", "StreamCompleteChunks", inference_pb2.StreamCompleteResponse)(
                pieces.messages(), timeout=timeout),
            lambda: raw_call(channel, "unary_stream", "StreamComplete", inference_pb2.StreamCompleteResponse)(
                one_message(), timeout=timeout))
    return PiecesCall(
        lambda: raw_call(channel, "stream_unary", "CompleteChunks", inference_pb2.CompleteResponse)(
            pieces.messages(), timeout=timeout),
        lambda: raw_call(channel, "unary_unary", "Complete", inference_pb2.CompleteResponse)(
            one_message(), timeout=timeout))

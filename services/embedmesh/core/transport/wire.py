"""Protobuf wire bytes for messages that carry big tensors, built with one copy of the tensor bytes.

Building a ``GenerateRequest`` the usual way copies a prompt's rows several times: ``ndarray.tobytes()``, the
``Tensor`` constructor, every nested constructor (``PromptSegment(embeds=...)``, ``GenerateRequest(segments=...)``)
and ``SerializeToString``. Measured on a 64 MiB float32 tensor here: ~370 ms for those steps together. The wire
format is simple enough to write those fields directly: the small parts (ids, sampling, a tensor's dtype and
shape) are serialized by protobuf, the rows are spliced in as a memoryview of the array, and one ``b"".join``
makes the request bytes — the only copy of the rows on the sending side. The bytes parse as the very message the
constructors would have built (tested field by field), so the receiver needs nothing special.

Receiving, protobuf copies the rows twice more (into its arena when parsing, and into a new ``bytes`` when
``.data`` is read). ``split_generate_request`` cuts the tensors' ``data`` out of the received bytes instead: the
rest parses as usual and each tensor's rows are a view of the received buffer, handed on by field path in a
``received.Received``. It handles only the plain shape of the message and leaves anything else to protobuf.

    body = generate_request_bytes(header, pieces, dtype)   # header: GenerateRequest without segments
    call = channel.unary_stream(GENERATE, request_serializer=None, ...)(body)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from embedmesh.core import fastpath, tensors
from embedmesh.core.transport.received import Received
from embedmesh.core.transport.thresholds import ZERO_COPY_MIN
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

__all__ = ["varint", "generate_request_bytes", "segment_parts", "split_generate_request", "split_generate_header",
           "parse_message", "parse_generate_request", "chunked_segments", "chunk_messages", "chunk_request_message",
           "chunk_rows_message", "row_pieces", "RowsPiece", "parse_chunk", "frame_start", "frame_rows", "RowsFrame",
           "parse_generate_many"]

_LEN = 2  # wire type of length-delimited fields
_SEGMENTS = worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["segments"].number
_EMBEDS = worker_pb2.PromptSegment.DESCRIPTOR.fields_by_name["embeds"].number
_DATA = tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int) -> bytes:
    return varint((field << 3) | _LEN)


def _rows_view(arr: np.ndarray, dtype: int) -> memoryview:
    """The rows as little-endian bytes of ``dtype``, without a copy when they already are."""
    data = np.ascontiguousarray(arr, dtype=tensors.numpy_dtype(dtype).newbyteorder("<"))
    return memoryview(data).cast("B")


def segment_parts(piece: tuple[int, ...] | np.ndarray, dtype: int) -> list[bytes | memoryview]:
    """One ``GenerateRequest.segments`` entry as wire parts (token ids, or rows sent as ``dtype``)."""
    if isinstance(piece, tuple):
        inner = worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=piece)).SerializeToString()
        return [_key(_SEGMENTS), varint(len(inner)), inner]
    rows = _rows_view(piece, dtype)
    return [_embeds_segment_head(piece, dtype, rows.nbytes), rows]


def _embeds_segment_head(piece: np.ndarray, dtype: int, data_bytes: int | None) -> bytes:
    """A ``segments`` entry holding ``piece`` as an embeds tensor, up to where its ``data`` bytes go: with
    ``data_bytes``, the field's key and length end it (the rows follow); None, the tensor has no ``data``."""
    head = tensor_pb2.Tensor(dtype=dtype, shape=list(piece.shape)).SerializeToString()  # type: ignore[arg-type]
    data_head = b"" if data_bytes is None else _key(_DATA) + varint(data_bytes)
    tensor_len = len(head) + len(data_head) + (data_bytes or 0)
    embeds_head = _key(_EMBEDS) + varint(tensor_len)
    return _key(_SEGMENTS) + varint(len(embeds_head) + tensor_len) + embeds_head + head + data_head


def generate_request_bytes(header: worker_pb2.GenerateRequest, pieces: Sequence[tuple[int, ...] | np.ndarray],
                           dtype: int) -> bytes:
    """``header`` (a GenerateRequest without segments) plus one segment per piece, as wire bytes; rows are
    copied once. Protobuf reads fields in any order and appends repeated ones, so this parses as ``header`` with
    ``segments`` set."""
    if len(header.segments):
        raise ValueError("header must not have segments")
    if not fastpath.enabled():  # the plain path: protobuf's constructors and serializer (core.fastpath)
        return _plain_generate_request(header, pieces, dtype)
    parts: list[bytes | memoryview] = [header.SerializeToString()]
    for piece in pieces:
        parts.extend(segment_parts(piece, dtype))
    return b"".join(parts)


def _plain_generate_request(header: worker_pb2.GenerateRequest, pieces: Sequence[tuple[int, ...] | np.ndarray],
                            dtype: int) -> bytes:
    request = worker_pb2.GenerateRequest()
    request.CopyFrom(header)
    for piece in pieces:
        if isinstance(piece, tuple):
            request.segments.add(token_ids=worker_pb2.TokenIds(ids=piece))
        else:
            request.segments.add(embeds=tensor_pb2.Tensor(dtype=dtype, shape=list(piece.shape),  # type: ignore[arg-type]
                                                          data=bytes(_rows_view(piece, dtype))))
    return request.SerializeToString()


def chunked_segments(pieces: Sequence[tuple[int, ...] | np.ndarray], dtype: int) -> tuple[bytes, list[memoryview]]:
    """One ``GenerateRequest.segments`` entry per piece as wire bytes, each embeds tensor with its dtype and shape
    but without ``data``; and those tensors' rows, in order, as views (sent after the request as ``rows`` frames of
    ``WorkerService.GenerateMany``, ``frame_rows``)."""
    parts: list[bytes | memoryview] = []
    rows: list[memoryview] = []
    for piece in pieces:
        if isinstance(piece, tuple):
            parts.extend(segment_parts(piece, dtype))
            continue
        rows.append(_rows_view(piece, dtype))
        parts.append(_embeds_segment_head(piece, dtype, None))
    return b"".join(parts), rows


_CHUNK_REQUEST = _key(inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["request"].number)
_CHUNK_ROWS = _key(inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["rows"].number)


def chunk_messages(request: bytes, rows: Sequence[memoryview], size: int) -> Iterator[bytes]:
    """A pieces stream (``transport.pieces``) as message bytes: the request (serialized, see ``chunked_segments``), then
    the rows in pieces of ``size`` bytes. Each piece is copied once, when it is about to be sent (still in cache)."""
    yield chunk_request_message(request)
    for _, piece in row_pieces(rows, size):
        yield chunk_rows_message(piece)


def row_pieces(rows: Sequence[memoryview], size: int) -> Iterator[tuple[int, memoryview]]:
    """``rows`` in pieces of at most ``size`` bytes (a piece never spans two views), each with the count of bytes up
    to its end."""
    end = 0
    for view in rows:
        for start in range(0, len(view), size):
            piece = view[start:start + size]
            end += len(piece)
            yield end, piece


def chunk_request_message(request: bytes) -> bytes:
    """A pieces stream's first message: ``request`` (serialized) as its ``request`` field."""
    return _CHUNK_REQUEST + varint(len(request)) + request


def chunk_rows_message(piece: bytes | memoryview) -> bytes:
    """A pieces stream's ``rows`` message, with one copy of ``piece``."""
    return b"".join((_CHUNK_ROWS, varint(len(piece)), piece))


# --- receiving: tensor bytes as views of the request bytes ----------------------------------------------------
class _Malformed(Exception):
    pass


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) of each field in ``buf[start:end]``."""
    out = []
    pos = start
    while pos < end:
        begin = pos
        key, pos = _read_varint(buf, pos, end)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise _Malformed
        if kind == 0:
            _, pos = _read_varint(buf, pos, end)
            out.append((number, kind, begin, pos, pos))
            continue
        if kind == 1:
            vstart, pos = pos, pos + 8
        elif kind == 5:
            vstart, pos = pos, pos + 4
        elif kind == 2:
            length, vstart = _read_varint(buf, pos, end)
            pos = vstart + length
        else:  # groups: never in our messages
            raise _Malformed
        if pos > end:
            raise _Malformed
        out.append((number, kind, begin, vstart, pos))
    return out


_TOKEN_IDS = worker_pb2.PromptSegment.DESCRIPTOR.fields_by_name["token_ids"].number
_PARAMS = inference_pb2.GenerateHeader.DESCRIPTOR.fields_by_name["completion"].number
_GENERATE_HEADER = inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["request"].number
_PROMPT_EMBEDS = inference_pb2.CompletionParams.DESCRIPTOR.fields_by_name["prompt_embeds"].number
_PE_TENSOR = inference_pb2.PromptEmbeds.DESCRIPTOR.fields_by_name["tensor"].number
_PE_ENCODED = inference_pb2.PromptEmbeds.DESCRIPTOR.fields_by_name["encoded"].number
_PE_CACHE_ID = inference_pb2.PromptEmbeds.DESCRIPTOR.fields_by_name["cache_id"].number
_ENCODED_DATA = tensor_pb2.EncodedTensor.DESCRIPTOR.fields_by_name["data"].number
_PE_SOURCES = {_PE_TENSOR: _DATA, _PE_ENCODED: _ENCODED_DATA, _PE_CACHE_ID: 0}
"""PromptEmbeds' oneof members -> the field holding their bytes (0: a cache id, kept as it is)."""


def split_generate_request(raw: bytes) -> Received | None:
    """``raw`` (a serialized GenerateRequest) with every embeddings tensor's ``data`` cut out and kept as a view;
    None when the bytes are not in the plain shape this handles (then the caller parses them as usual, which also
    words any error): every segment holds at most one ``embeds`` and no ``token_ids`` beside it, every tensor at
    most one ``data`` — the cases where cutting fields out cannot change what protobuf's merge rules give."""
    buf = memoryview(raw)
    try:
        top = _fields(buf, 0, len(buf))
        if not any(n == _SEGMENTS and k == _LEN for n, k, *_ in top):
            return None
        parts: list[bytes | memoryview] = []
        views: dict[str, memoryview] = {}
        index = 0
        for number, kind, begin, vstart, vend in top:
            if number != _SEGMENTS or kind != _LEN:
                parts.append(buf[begin:vend])
                continue
            seg = _fields(buf, vstart, vend)
            embeds = [f for f in seg if f[0] == _EMBEDS]
            if not embeds:
                parts.append(buf[begin:vend])
                index += 1
                continue
            if len(embeds) > 1 or any(f[0] == _TOKEN_IDS for f in seg) or embeds[0][1] != _LEN:
                return None
            seg_parts: list[bytes | memoryview] = []
            for f in seg:
                if f[0] != _EMBEDS:
                    seg_parts.append(buf[f[2]:f[4]])
                    continue
                cut = _cut_tensor(buf, f, _EMBEDS, views, f"segments[{index}].embeds")
                if cut is None:
                    return None
                seg_parts.append(cut)
            inner = b"".join(seg_parts)
            parts.append(_key(_SEGMENTS) + varint(len(inner)) + inner)
            index += 1
        message = worker_pb2.GenerateRequest.FromString(b"".join(parts))
    except Exception:  # noqa: BLE001 - anything odd (_Malformed included): the ordinary parser decides
        return None
    return Received(message, views)


def _cut_tensor(buf: memoryview, f: tuple[int, int, int, int, int], field: int,
                views: dict[str, memoryview], path: str, data_field: int = 0) -> bytes | None:
    """Field ``f`` (a Tensor, or an EncodedTensor, under ``field``) re-encoded without its ``data``, which goes to
    ``views[path]``; None when it holds ``data`` more than once (protobuf keeps the last: leave it to protobuf)."""
    data_field = data_field or _DATA
    tensor = _fields(buf, f[3], f[4])
    data = [t for t in tensor if t[0] == data_field]
    if len(data) > 1 or (data and data[0][1] != _LEN):
        return None
    kept = b"".join(buf[t[2]:t[4]] for t in tensor if t[0] != data_field)
    if data:
        views[path] = buf[data[0][3]:data[0][4]]
    return _key(field) + varint(len(kept)) + kept


def _split_params(buf: memoryview, start: int, end: int) -> tuple[bytes, dict[str, memoryview]] | None:
    """The message in ``buf[start:end]`` whose field 1 is ``CompletionParams`` (a ``GenerateHeader``'s
    ``completion``), re-encoded with the bytes of ``prompt_embeds`` (raw tensors, and serialized ones as the gateway
    sends them) cut out, and those bytes as views under the field names the preprocessor reports them with
    (``prompt_embeds`` for one, ``prompt_embeds[i]`` for several). None unless it has its plain shape: field 1
    once, and each ``prompt_embeds`` entry with at most one source. Raises ``_Malformed`` on bytes that are not
    protobuf."""
    top = _fields(buf, start, end)
    params = [f for f in top if f[0] == _PARAMS]
    if len(params) != 1 or params[0][1] != _LEN:
        return None
    inner = _fields(buf, params[0][3], params[0][4])
    entries = [f for f in inner if f[0] == _PROMPT_EMBEDS]
    if not entries or any(f[1] != _LEN for f in entries):
        return None
    views: dict[str, memoryview] = {}
    out: list[bytes | memoryview] = []
    index = 0
    for f in inner:
        if f[0] != _PROMPT_EMBEDS:
            out.append(buf[f[2]:f[4]])
            continue
        source = _fields(buf, f[3], f[4])
        kinds = [x[0] for x in source if x[0] in _PE_SOURCES]
        if len(kinds) > 1 or (kinds and (len(source) != 1 or source[0][1] != _LEN)):
            return None  # a source beside another (a oneof), or an odd encoding: protobuf's rules decide
        if not kinds or kinds[0] == _PE_CACHE_ID:
            out.append(buf[f[2]:f[4]])
            index += 1
            continue
        path = "prompt_embeds" if len(entries) == 1 else f"prompt_embeds[{index}]"
        cut = _cut_tensor(buf, source[0], kinds[0], views, path, _PE_SOURCES[kinds[0]])
        if cut is None:
            return None
        out.append(_key(_PROMPT_EMBEDS) + varint(len(cut)) + cut)
        index += 1
    body = b"".join(out)
    rest = b"".join(buf[f[2]:f[4]] for f in top if f[0] != _PARAMS)
    return _key(_PARAMS) + varint(len(body)) + body + rest, views


def split_generate_header(raw: bytes) -> Received | None:
    """``split_generate_request`` for an ``InferenceService.Generate`` message holding a completion's header: the
    bytes of ``completion.prompt_embeds`` become views (see ``_split_params``), so a prompt sent inline in one
    message is not copied out of the received buffer. None unless the message is ``request`` alone, in its plain
    shape (a chat, rows, or anything odd: protobuf parses it and words any error)."""
    buf = memoryview(raw)
    try:
        top = _fields(buf, 0, len(buf))
        if len(top) != 1 or top[0][0] != _GENERATE_HEADER or top[0][1] != _LEN:
            return None
        cut = _split_params(buf, top[0][3], top[0][4])
        if cut is None:
            return None
        header, views = cut
        message = inference_pb2.GenerateRequest.FromString(_key(_GENERATE_HEADER) + varint(len(header)) + header)
    except Exception:  # noqa: BLE001 - anything odd: the ordinary parser decides (and words the error)
        return None
    return Received(message, views)


def parse_message(cls: Any, split: Callable[[bytes], Received | None]) -> Callable[[bytes], Received]:
    """A request deserializer for ``cls`` giving a ``Received``: for requests big enough to carry tensors, what
    ``split`` makes of them (their bytes are not copied out of the received buffer); else the plain message."""
    def parse(raw: bytes) -> Received:
        if len(raw) >= ZERO_COPY_MIN and fastpath.enabled():  # off: protobuf's parser (core.fastpath)
            out = split(raw)
            if out is not None:
                return out
        return Received(cls.FromString(raw))

    return parse


parse_generate_request = parse_message(worker_pb2.GenerateRequest, split_generate_request)
"""A one-message ``GenerateRequest`` deserializer whose big tensors stay views of the received bytes."""


class RowsPiece(NamedTuple):
    """A pieces-stream message holding only ``rows`` (``pieces``): the bytes as a view of the received buffer."""

    data: memoryview


def parse_chunk(cls: Any, split: Callable[[bytes], Received | None] | None = None) -> Callable[[bytes], Any]:
    """A request deserializer for a pieces stream of ``cls`` (``oneof part { request = 1; bytes rows = 2; }``): a
    message that is exactly one ``rows`` field becomes a ``RowsPiece`` (protobuf would copy the bytes twice: into
    its arena, then into a new ``bytes`` when the field is read); a big ``request`` message becomes the
    ``Received`` that ``split`` makes of it, if any (its inline tensors as views, ``core.transport.pieces.start``);
    anything else is parsed by protobuf (which words its errors)."""
    assert _key(cls.DESCRIPTOR.fields_by_name["rows"].number) == _CHUNK_ROWS
    assert _key(cls.DESCRIPTOR.fields_by_name["request"].number) == _CHUNK_REQUEST  # chunk_messages writes any of them

    def parse(raw: bytes) -> Any:
        if len(raw) >= ZERO_COPY_MIN:
            if raw[:len(_CHUNK_ROWS)] == _CHUNK_ROWS:
                buf = memoryview(raw)
                try:
                    n, pos = _read_varint(buf, len(_CHUNK_ROWS), len(buf))
                except _Malformed:
                    n, pos = -1, 0
                if pos + n == len(buf):
                    return RowsPiece(buf[pos:])
            elif split is not None and fastpath.enabled():  # off: protobuf's parser (core.fastpath)
                out = split(raw)
                if out is not None:
                    return out
        return cls.FromString(raw)

    return parse


# --- WorkerService.GenerateMany frames ------------------------------------------------------------------------
_FRAMES = _key(worker_pb2.GenerateManyRequest.DESCRIPTOR.fields_by_name["frames"].number)
_FRAME_ID = varint(worker_pb2.GenerateFrame.DESCRIPTOR.fields_by_name["id"].number << 3)
_FRAME_GENERATE = _key(worker_pb2.GenerateFrame.DESCRIPTOR.fields_by_name["generate"].number)
_FRAME_ROWS = _key(worker_pb2.GenerateFrame.DESCRIPTOR.fields_by_name["rows"].number)


def frame_start(gid: int, request: bytes | memoryview, trace_context: dict[str, str] | None = None) -> bytes:
    """A ``GenerateManyRequest`` holding one start frame: generation ``gid`` of ``request`` (serialized)."""
    head = worker_pb2.GenerateFrame(id=gid, trace_context=trace_context or {}).SerializeToString()
    inner_len = len(head) + len(_FRAME_GENERATE) + len(varint(len(request))) + len(request)
    return b"".join((_FRAMES, varint(inner_len), head, _FRAME_GENERATE, varint(len(request)), request))


def frame_rows(gid: int, piece: bytes | memoryview) -> bytes:
    """A ``GenerateManyRequest`` holding one ``rows`` frame of generation ``gid``, with one copy of ``piece``: the
    shape ``parse_generate_many`` hands over as a ``RowsFrame`` without copying."""
    head = _FRAME_ID + varint(gid) + _FRAME_ROWS + varint(len(piece))
    return b"".join((_FRAMES, varint(len(head) + len(piece)), head, piece))


class RowsFrame(NamedTuple):
    """A ``GenerateManyRequest`` that is exactly one ``rows`` frame: its id and the bytes as a view of the received
    buffer (protobuf would copy them twice: into its arena, then into a new ``bytes`` when the field is read)."""

    id: int
    data: memoryview


def _rows_frame(buf: memoryview) -> RowsFrame | None:
    """``buf`` as a ``RowsFrame`` when it is ``frames { id: N rows: ... }`` and nothing else (as ``frame_rows``
    writes it)."""
    if buf[:len(_FRAMES)] != _FRAMES:
        return None
    n, pos = _read_varint(buf, len(_FRAMES), len(buf))
    if pos + n != len(buf) or buf[pos:pos + len(_FRAME_ID)] != _FRAME_ID:
        return None
    gid, pos = _read_varint(buf, pos + len(_FRAME_ID), len(buf))
    if buf[pos:pos + len(_FRAME_ROWS)] != _FRAME_ROWS:
        return None
    n, pos = _read_varint(buf, pos + len(_FRAME_ROWS), len(buf))
    if pos + n != len(buf):
        return None
    return RowsFrame(gid, buf[pos:])


def parse_generate_many(raw: bytes) -> Any:
    """``WorkerService.GenerateMany``'s request deserializer: a big message that is one ``rows`` frame becomes a
    ``RowsFrame`` (its bytes uncopied); anything else is parsed by protobuf (which words its errors)."""
    if len(raw) >= ZERO_COPY_MIN:
        try:
            frame = _rows_frame(memoryview(raw))
        except _Malformed:
            frame = None
        if frame is not None:
            return frame
    return worker_pb2.GenerateManyRequest.FromString(raw)

"""Decode one serialized tensor without torch and without running pickle code.

Accepted containers:
- ``torch.save`` zip archives (what vLLM's REST clients send, base64-decoded). ``data.pkl`` is read by a
  restricted unpickler that resolves only the globals a plain dense tensor needs (``_rebuild_tensor_v2``,
  ``_rebuild_parameter``, typed storage classes, ``OrderedDict``) to harmless stand-ins; any other global is refused
  before it is looked up, so no constructor, ``os.system`` or ``eval`` ever runs. Storages come from the archive's
  ``data/<key>`` entries and are read only after the dense size passed the cap.
- safetensors files holding exactly one tensor (the pickle-free alternative).

Both return ``(array, DataType)``; bfloat16 comes back as its raw uint16 bits (see ``embedmesh.core.tensors``).
Every failure is an ``InvalidArgument`` naming the caller's field, with a reason a program can switch on.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensors import BF16_STORAGE
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["decode_tensor_bytes", "decode_torch_save", "decode_safetensors", "format_bytes", "check_cap"]

_ZIP_MAGIC = b"PK\x03\x04"
_MAX_PICKLE_BYTES = 1 << 20
"""data.pkl of one tensor is a few hundred bytes; anything large is not a plain tensor."""

# torch storage class -> (numpy dtype, DataType)
_STORAGES: dict[str, tuple[np.dtype, int]] = {
    "FloatStorage": (np.dtype("<f4"), tensor_pb2.DATA_TYPE_FP32),
    "DoubleStorage": (np.dtype("<f8"), tensor_pb2.DATA_TYPE_FP64),
    "HalfStorage": (np.dtype("<f2"), tensor_pb2.DATA_TYPE_FP16),
    "BFloat16Storage": (BF16_STORAGE, tensor_pb2.DATA_TYPE_BF16),
    "LongStorage": (np.dtype("<i8"), tensor_pb2.DATA_TYPE_INT64),
    "IntStorage": (np.dtype("<i4"), tensor_pb2.DATA_TYPE_INT32),
    "ShortStorage": (np.dtype("<i2"), tensor_pb2.DATA_TYPE_INT16),
    "CharStorage": (np.dtype("i1"), tensor_pb2.DATA_TYPE_INT8),
    "ByteStorage": (np.dtype("u1"), tensor_pb2.DATA_TYPE_UINT8),
    "BoolStorage": (np.dtype("?"), tensor_pb2.DATA_TYPE_BOOL),
}
_COMPLEX_STORAGES = {"ComplexFloatStorage", "ComplexDoubleStorage", "ComplexHalfStorage"}

_SAFETENSORS_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), tensor_pb2.DATA_TYPE_FP32),
    "F64": (np.dtype("<f8"), tensor_pb2.DATA_TYPE_FP64),
    "F16": (np.dtype("<f2"), tensor_pb2.DATA_TYPE_FP16),
    "BF16": (BF16_STORAGE, tensor_pb2.DATA_TYPE_BF16),
    "I64": (np.dtype("<i8"), tensor_pb2.DATA_TYPE_INT64),
    "I32": (np.dtype("<i4"), tensor_pb2.DATA_TYPE_INT32),
    "I16": (np.dtype("<i2"), tensor_pb2.DATA_TYPE_INT16),
    "I8": (np.dtype("i1"), tensor_pb2.DATA_TYPE_INT8),
    "U8": (np.dtype("u1"), tensor_pb2.DATA_TYPE_UINT8),
    "BOOL": (np.dtype("?"), tensor_pb2.DATA_TYPE_BOOL),
}


def format_bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _bad(field: str, reason: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", field=field, reason=reason)


def check_cap(field: str, nbytes: int, max_bytes: int, what: str = "decoded size") -> None:
    if nbytes > max_bytes:
        raise _bad(field, "TOO_LARGE",
                   f"{what} {format_bytes(nbytes)} exceeds the {format_bytes(max_bytes)} cap "
                   f"(EMBEDMESH_MAX_EMBEDS_BYTES); send fewer rows or a smaller dtype")


def decode_tensor_bytes(data: bytes, *, max_bytes: int, field: str) -> tuple[np.ndarray, int]:
    """Sniff the container (torch.save zip or safetensors) and decode it."""
    if data[:4] == _ZIP_MAGIC:
        return decode_torch_save(data, max_bytes=max_bytes, field=field)
    if len(data) >= 10 and data[8:9] == b"{":
        return decode_safetensors(data, max_bytes=max_bytes, field=field)
    if data[:1] == b"\x80":
        raise _bad(field, "LEGACY_FORMAT",
                   "this is torch's legacy (non-zip) serialization or a bare pickle; save with torch.save's default "
                   "zip format, or send safetensors")
    raise _bad(field, "NOT_A_TENSOR",
               "not a serialized tensor: expected the bytes of torch.save(tensor) (a zip archive) or a safetensors "
               "file")


# --- torch.save -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass(frozen=True)
class _StorageRef:
    name: str
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise _Refused("NOT_A_TENSOR", "tensor rebuilt from something that is not a storage")
    if not (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)):
        raise _Refused("NOT_A_TENSOR", "malformed tensor header")
    if len(size) != len(stride) or not all(isinstance(d, int) and d >= 0 for d in size + stride) or offset < 0:
        raise _Refused("NOT_A_TENSOR", "malformed tensor shape or strides")
    return _TensorRef(storage, offset, size, stride)


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals of a plain dense tensor; everything else is refused before lookup."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if module == "torch" and name in _COMPLEX_STORAGES:
            raise _Refused("UNSUPPORTED_DTYPE", "complex tensors are not prompt embeddings")
        if "sparse" in name or name in ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"):
            raise _Refused("SPARSE_TENSOR", "sparse tensors are not accepted; send a dense tensor (.to_dense())")
        raise _Refused("UNSAFE_PICKLE",
                       f"the pickle references {module}.{name}, which a plain tensor never needs; refused unexecuted")

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
                or not isinstance(pid[4], int) or pid[4] < 0):
            raise _Refused("NOT_A_TENSOR", "unexpected persistent reference in the pickle")
        return _StorageRef(pid[1].name, pid[2], pid[4])


def decode_torch_save(data: bytes, *, max_bytes: int, field: str) -> tuple[np.ndarray, int]:
    """Decode the bytes of ``torch.save(tensor)``; see the module docstring for the safety rules."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise _bad(field, "NOT_A_TENSOR", f"not a readable torch.save archive ({e})") from None
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise _bad(field, "NOT_A_TENSOR", "zip archive without a torch data.pkl: not a torch.save file")
    prefix = pkl[0][: -len("data.pkl")]
    info = archive.getinfo(pkl[0])
    if info.file_size > _MAX_PICKLE_BYTES:
        raise _bad(field, "NOT_A_TENSOR", "the archive's pickle is far larger than a single tensor's")
    try:
        obj = _SafeUnpickler(io.BytesIO(archive.read(pkl[0]))).load()
    except _Refused as e:
        raise _bad(field, e.reason, e.message) from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle is a client error
        raise _bad(field, "NOT_A_TENSOR", f"unreadable pickle in the archive ({type(e).__name__})") from None
    if not isinstance(obj, _TensorRef):
        raise _bad(field, "NOT_A_TENSOR",
                   f"the file holds a {type(obj).__name__}, not one tensor; torch.save a single tensor")
    np_dtype, dtype = _STORAGES[obj.storage.name]
    count = 1
    for d in obj.size:
        count *= d
    check_cap(field, count * np_dtype.itemsize, max_bytes)
    storage_bytes = obj.storage.numel * np_dtype.itemsize
    check_cap(field, storage_bytes, max(max_bytes, 1), "storage size")
    if count:
        last = obj.offset + sum((d - 1) * s for d, s in zip(obj.size, obj.stride, strict=True))
        if last >= obj.storage.numel:
            raise _bad(field, "NOT_A_TENSOR", "tensor view reaches past the end of its storage")
    entry = f"{prefix}data/{obj.storage.key}"
    try:
        entry_info = archive.getinfo(entry)
    except KeyError:
        raise _bad(field, "NOT_A_TENSOR", "storage entry missing from the archive (truncated file?)") from None
    if entry_info.file_size < storage_bytes:
        raise _bad(field, "NOT_A_TENSOR",
                   f"storage holds {entry_info.file_size} bytes but the header needs {storage_bytes} (truncated?)")
    try:
        raw = archive.read(entry)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise _bad(field, "NOT_A_TENSOR", f"storage unreadable ({e}); truncated or corrupted file") from None
    byteorder = b"little"
    if f"{prefix}byteorder" in names:
        byteorder = archive.read(f"{prefix}byteorder").strip()
    storage = np.frombuffer(raw, dtype=np_dtype, count=obj.storage.numel)
    if byteorder == b"big":
        storage = storage.byteswap()
    if count == 0:
        return np.zeros(obj.size, dtype=np_dtype), dtype
    view = np.lib.stride_tricks.as_strided(
        storage[obj.offset:], shape=obj.size, strides=tuple(s * np_dtype.itemsize for s in obj.stride),
        writeable=False,
    )
    return np.ascontiguousarray(view), dtype


# --- safetensors ----------------------------------------------------------------------------------------------


def decode_safetensors(data: bytes, *, max_bytes: int, field: str) -> tuple[np.ndarray, int]:
    """Decode a safetensors file holding exactly one tensor."""
    if len(data) < 8:
        raise _bad(field, "NOT_A_TENSOR", "safetensors file shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, 100 << 20):
        raise _bad(field, "NOT_A_TENSOR", "safetensors header length runs past the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise _bad(field, "NOT_A_TENSOR", "safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _bad(field, "NOT_A_TENSOR", "safetensors header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(tensors) != 1:
        raise _bad(field, "NOT_A_TENSOR", f"safetensors file holds {len(tensors)} tensors; send exactly one")
    (meta,) = tensors.values()
    if not isinstance(meta, dict):
        raise _bad(field, "NOT_A_TENSOR", "safetensors tensor entry is not an object")
    kind = meta.get("dtype")
    shape = meta.get("shape")
    offsets = meta.get("data_offsets")
    if kind not in _SAFETENSORS_DTYPES:
        raise _bad(field, "UNSUPPORTED_DTYPE", f"safetensors dtype {kind!r} is not supported")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise _bad(field, "NOT_A_TENSOR", "safetensors shape or data_offsets malformed")
    np_dtype, dtype = _SAFETENSORS_DTYPES[kind]
    count = 1
    for d in shape:
        count *= d
    check_cap(field, count * np_dtype.itemsize, max_bytes)
    begin, end = offsets
    body = len(data) - 8 - n
    if end < begin or end > body or end - begin != count * np_dtype.itemsize:
        raise _bad(field, "NOT_A_TENSOR", "safetensors data_offsets do not match the shape and the file size")
    start = 8 + n + begin
    arr = np.frombuffer(data, dtype=np_dtype, count=count, offset=start).reshape(shape)
    return arr.copy(), dtype

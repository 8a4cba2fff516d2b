"""Decode one serialized tensor without torch and without running pickle code.

Accepted containers:
- ``torch.save`` zip archives (what vLLM's REST clients send, base64-decoded). ``data.pkl`` is read by a
  restricted unpickler whose ``find_class`` resolves only the globals a plain dense tensor needs
  (``_rebuild_tensor_v2``, ``_rebuild_parameter``, ``_rebuild_from_type_v2`` for ``torch.Tensor``, the typed storage
  classes, ``OrderedDict``) to harmless stand-ins of this module. Any other global is refused before it is looked
  up, so no constructor, ``os.system`` or ``eval`` ever runs. Storages come from the archive's ``data/<key>`` entries
  and are read only after the dense size and the storage size have passed the cap.
- safetensors files holding exactly one tensor (the pickle-free alternative).

Both return ``(array, DataType)``; the array is C-contiguous, owns its memory, and holds bfloat16 as raw uint16
bits (see ``embedmesh.core.tensors``). Integer and bool tensors decode too, so the caller can refuse them by dtype
rather than with a parse error.

Sizes are bounded before arithmetic: rank and every dimension first (``tensors.check_shape``), then the element
count (an exact Python int) against the cap, then strides and the storage offset against the storage, all before
numpy sees a shape or a stride. Views (slices, transposes, ``expand``) decode to their values, as ``torch.load``
would give them; a stride of a dimension of size 0 or 1 addresses nothing and is ignored. Every failure is an
``InvalidArgument`` naming the caller's field, with one of these reasons:

    NOT_A_TENSOR       not one readable dense tensor (random bytes, a dict or list, truncated or inconsistent file,
                       a shape or offset that needs more elements than the storage holds)
    BAD_RANK           more than ``tensors.MAX_RANK`` (8) dimensions
    INVALID_SHAPE      a dimension outside [0, 2**31]
    BAD_STRIDES        a stride of 2**63 or more (not an int64, so no torch tensor has it), or strides that address
                       elements past the storage although the storage holds as many elements as the shape
    LEGACY_FORMAT      torch's pre-1.6 non-zip serialization, or a bare pickle
    UNSAFE_PICKLE      the pickle names a global a plain tensor never needs (refused unexecuted)
    SPARSE_TENSOR      a sparse layout (COO, CSR, ...)
    UNSUPPORTED_DTYPE  complex, quantized, float8, uint16/32/64 ...
    TOO_LARGE          the dense or storage size is over the cap
    COMPRESSED_ENTRY   an entry read is compressed (torch.save never compresses; a DEFLATE stream can claim a small
                       size in the zip headers and inflate to gigabytes)

Archive entries are never trusted for their sizes: every entry read must be STORED; the storage is viewed in place
(bounded by the request's own bytes), and the small entries (``data.pkl``, ``byteorder``) are read through a
bounded stream of at most their limit plus one byte, whatever their headers claim (``_read_small_entry``).
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensors import DTYPES, check_shape, format_dims
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["decode_tensor_bytes", "decode_torch_save", "decode_safetensors", "format_bytes", "check_cap",
           "stored_tensor", "StoredTensor"]

DEFAULT_CAP_NAME = "EMBEDMESH_MAX_EMBEDS_BYTES"

_ZIP_MAGIC = b"PK\x03\x04"
_MAX_PICKLE_BYTES = 1 << 20
_MAX_BYTEORDER_BYTES = 16
"""data.pkl of one tensor is a few hundred bytes; anything large is not a plain tensor."""
_MAX_SAFETENSORS_HEADER = 1 << 20
"""The JSON header of a one-tensor safetensors file is under a hundred bytes."""
_MAX_STRIDE = (1 << 63) - 1
"""torch strides are int64."""

# torch storage class -> (numpy dtype, DataType), from the one vocabulary (``tensors.DTYPES``). These are the
# dtypes torch.save writes with _rebuild_tensor_v2; newer ones (float8, uint16/32/64, complex32) go through
# _rebuild_tensor_v3, which is refused as a dtype.
_STORAGES: dict[str, tuple[np.dtype, int]] = {i.torch_storage: (i.numpy, k) for k, i in DTYPES.items()}

_SAFETENSORS_DTYPES: dict[str, tuple[np.dtype, int]] = {i.safetensors: (i.numpy, k) for k, i in DTYPES.items()}

_COMPRESSED = ("the archive has a compressed entry; torch.save never compresses: send the bytes torch.save wrote, "
               "unchanged, or a safetensors file")
_DENSE_HINT = "send one plain dense tensor: torch.save(t.detach().cpu().contiguous())"


def format_bytes(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _bad(field: str, reason: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", field=field, reason=reason)


def check_cap(field: str, nbytes: int, max_bytes: int, what: str = "decoded size", *,
              cap_name: str = DEFAULT_CAP_NAME) -> None:
    """Refuse ``nbytes`` over ``max_bytes`` (TOO_LARGE). Call it before allocating, with sizes from headers."""
    if nbytes > max_bytes:
        raise _bad(field, "TOO_LARGE",
                   f"{what} {format_bytes(nbytes)} exceeds the {format_bytes(max_bytes)} cap ({cap_name}); "
                   f"send fewer rows or a smaller dtype")


def decode_tensor_bytes(data: bytes, *, max_bytes: int, field: str,
                        cap_name: str = DEFAULT_CAP_NAME) -> tuple[np.ndarray, int]:
    """Sniff the container (torch.save zip or safetensors) and decode it."""
    if bytes(data[:4]) == _ZIP_MAGIC:
        return decode_torch_save(data, max_bytes=max_bytes, field=field, cap_name=cap_name)
    if len(data) >= 10 and bytes(data[8:9]) == b"{":
        return decode_safetensors(data, max_bytes=max_bytes, field=field, cap_name=cap_name)
    _refuse_unknown_container(data, field)


def _refuse_unknown_container(data: bytes, field: str) -> NoReturn:
    if bytes(data[:1]) == b"\x80":  # pickle protocol opcode: legacy torch.save or a bare pickle.dumps
        raise _bad(field, "LEGACY_FORMAT",
                   "this is torch's legacy (non-zip) serialization or a bare pickle; save with torch.save's default "
                   "zip format, or send safetensors")
    raise _bad(field, "NOT_A_TENSOR",
               "not a serialized tensor: expected the bytes of torch.save(tensor) (a zip archive) or a safetensors "
               "file")


# --- torch.save: the restricted unpickler -----------------------------------------------------------------------


@dataclass(frozen=True)
class _StorageType:
    """Stand-in for ``torch.FloatStorage`` & co.: only ever used as a tag inside a persistent id."""

    name: str


@dataclass(frozen=True)
class _TensorType:
    """Stand-in for ``torch.Tensor`` as the ``new_type`` argument of ``_rebuild_from_type_v2``."""


@dataclass(frozen=True)
class _StorageRef:
    name: str
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    """What the pickle describes; no data has been read yet."""

    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    negated: bool
    """torch's lazy negation bit (``metadata={"neg": True}``): the storage holds the values' negatives."""


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _is_index(v: Any) -> bool:
    return type(v) is int and v >= 0


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None, *extra: Any) -> _TensorRef:
    # requires_grad and backward_hooks do not change the values; hooks are never serialized (always empty).
    if extra or not isinstance(storage, _StorageRef):
        raise _Refused("NOT_A_TENSOR", "malformed tensor record in the pickle")
    if not (_is_index(offset) and isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and all(_is_index(d) for d in size + stride)):
        raise _Refused("NOT_A_TENSOR", "malformed tensor shape, strides or storage offset in the pickle")
    negated = False
    if metadata:
        # torch writes only lazy conj/neg bits here; conj of a real tensor is the identity.
        if not isinstance(metadata, dict) or not set(metadata) <= {"neg", "conj"}:
            raise _Refused("NOT_A_TENSOR", f"unknown tensor metadata {sorted(map(str, metadata))}; {_DENSE_HINT}")
        negated = metadata.get("neg") is True
    return _TensorRef(storage, offset, size, stride, negated)


def _rebuild_parameter(data: Any, *_rest: Any) -> _TensorRef:
    # nn.Parameter(data, requires_grad, hooks[, python state]): the values are data's.
    if not isinstance(data, _TensorRef):
        raise _Refused("NOT_A_TENSOR", "malformed nn.Parameter record in the pickle")
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, _state: Any) -> _TensorRef:
    # A torch.Tensor carrying Python attributes (t.foo = 1) is saved this way; the attributes are dropped.
    if func is not _rebuild_tensor_v2 or not isinstance(new_type, _TensorType) or not isinstance(args, tuple):
        raise _Refused("NOT_A_TENSOR", f"tensor subclasses are not accepted; {_DENSE_HINT}")
    return _rebuild_tensor_v2(*args)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType(),
    ("torch._tensor", "Tensor"): _TensorType(),
    ("collections", "OrderedDict"): OrderedDict,  # the empty backward_hooks argument
    **{("torch", name): _StorageType(name) for name in _STORAGES},
}

# Globals of tensors that are real but not plain dense ones: refused with a reason that says what to send instead.
_KNOWN_REFUSALS: dict[tuple[str, str], tuple[str, str]] = {
    ("torch._utils", "_rebuild_sparse_tensor"): (
        "SPARSE_TENSOR", "sparse tensors are not accepted; send a dense tensor (t.to_dense())"),
    ("torch._utils", "_rebuild_sparse_csr_tensor"): (
        "SPARSE_TENSOR", "sparse tensors are not accepted; send a dense tensor (t.to_dense())"),
    ("torch._utils", "_rebuild_tensor_v3"): (
        "UNSUPPORTED_DTYPE", "float8, uint16/32/64 and complex32 tensors are not accepted; send float32, float16, "
        "bfloat16 or float64"),
    ("torch._utils", "_rebuild_qtensor"): (
        "UNSUPPORTED_DTYPE", "quantized tensors are not accepted; send t.dequantize()"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): (
        "NOT_A_TENSOR", "a meta tensor has no values; send a tensor with data"),
    ("torch._utils", "_rebuild_nested_tensor"): ("NOT_A_TENSOR", f"nested tensors are not accepted; {_DENSE_HINT}"),
    ("torch._utils", "_rebuild_wrapper_subclass"): (
        "NOT_A_TENSOR", f"tensor subclasses are not accepted; {_DENSE_HINT}"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals of a plain dense tensor, to local stand-ins; everything else is refused unlooked."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        known = _KNOWN_REFUSALS.get((module, name))
        if known is not None:
            raise _Refused(*known)
        if module == "torch" and name.endswith("Storage"):  # ComplexFloatStorage, QInt8Storage, ...
            raise _Refused("UNSUPPORTED_DTYPE",
                           f"{name[:-len('Storage')] or 'untyped'} tensors are not accepted; send float32, float16, "
                           f"bfloat16 or float64")
        raise _Refused("UNSAFE_PICKLE",
                       f"the pickle references {module}.{name}, which a plain tensor never needs; refused unexecuted")

    def persistent_load(self, pid: Any) -> _StorageRef:
        # torch.save writes ("storage", storage class, key, location, numel in elements) for typed storages.
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
                or not isinstance(pid[3], str) or not _is_index(pid[4])):
            raise _Refused("NOT_A_TENSOR", "unexpected persistent reference in the pickle")
        return _StorageRef(pid[1].name, pid[2], pid[4])


# --- torch.save: the archive ------------------------------------------------------------------------------------


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (``io.BytesIO`` would copy it): zipfile reads the directory
    and the small pickle through it; storages are viewed in place (``_read_storage``)."""

    def __init__(self, data: Any) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        chunk = self._view[self._pos:self._pos + len(b)]
        n = len(chunk)
        b[:n] = chunk
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._view[self._pos:end])
        self._pos += len(chunk)
        return chunk


@dataclass(frozen=True)
class _Parsed:
    """A torch.save archive whose pickle described one tensor that passed the size and stride checks; no storage
    bytes read yet."""

    archive: zipfile.ZipFile
    prefix: str
    obj: _TensorRef
    np_dtype: np.dtype
    dtype: int
    count: int
    strides: tuple[int, ...]

    @property
    def storage_name(self) -> str:
        """The archive entry holding the tensor's storage."""
        return f"{self.prefix}data/{self.obj.storage.key}"


def _parse_torch_save(data: bytes | memoryview, max_bytes: int, field: str, cap_name: str) -> _Parsed:
    if bytes(data[:4]) != _ZIP_MAGIC:
        _refuse_unknown_container(data, field)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else _ViewFile(data))
    except Exception as e:  # noqa: BLE001 - any unreadable archive is the client's
        raise _bad(field, "NOT_A_TENSOR", f"not a readable torch.save archive ({type(e).__name__})") from None
    names = archive.namelist()
    pkl = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise _bad(field, "NOT_A_TENSOR", "zip archive without exactly one data.pkl: not a torch.save file")
    prefix = pkl[0][: -len("data.pkl")]
    raw = _read_small_entry(archive, pkl[0], _MAX_PICKLE_BYTES, field)
    try:
        obj = _SafeUnpickler(io.BytesIO(raw)).load()
    except _Refused as e:
        raise _bad(field, e.reason, e.message) from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle or archive is a client error
        raise _bad(field, "NOT_A_TENSOR", f"unreadable pickle in the archive ({type(e).__name__})") from None
    if not isinstance(obj, _TensorRef):
        kind = "tensor-shaped object" if isinstance(obj, (_StorageRef, _StorageType)) else type(obj).__name__
        raise _bad(field, "NOT_A_TENSOR", f"the file holds a {kind}, not one tensor; torch.save a single tensor")

    np_dtype, dtype = _STORAGES[obj.storage.name]
    # Everything below comes from the pickle alone and is checked with Python ints: nothing proportional to it
    # has been allocated, and numpy sees a shape or a stride only once the layout is known to be in bounds.
    count = check_shape(obj.size, field)
    check_cap(field, count * np_dtype.itemsize, max_bytes, cap_name=cap_name)
    check_cap(field, obj.storage.numel * np_dtype.itemsize, max_bytes, "storage size", cap_name=cap_name)
    strides = _checked_strides(obj, count, field)
    return _Parsed(archive, prefix, obj, np_dtype, dtype, count, strides)


def decode_torch_save(data: bytes, *, max_bytes: int, field: str,
                      cap_name: str = DEFAULT_CAP_NAME) -> tuple[np.ndarray, int]:
    """Decode the bytes of ``torch.save(tensor)``; see the module docstring for the safety rules."""
    p = _parse_torch_save(data, max_bytes, field, cap_name)
    obj, np_dtype = p.obj, p.np_dtype
    numel = obj.storage.numel
    storage = _read_storage(p.archive, data, p.storage_name, numel * np_dtype.itemsize, field)
    flat = np.frombuffer(storage, dtype=np_dtype, count=numel)
    if p.count == 0:
        out = np.zeros(obj.size, dtype=np_dtype)
    else:
        view = np.lib.stride_tricks.as_strided(
            flat[obj.offset:], shape=obj.size, strides=tuple(s * np_dtype.itemsize for s in p.strides),
            writeable=False,
        )
        out = np.array(view, order="C", copy=True)  # the one dense copy; frees us from the request's bytes
    if _byteorder(p.archive, p.prefix, field) == "big":
        out.byteswap(inplace=True)
    if obj.negated:
        _negate(out, p.dtype, field)
    return out, p.dtype


@dataclass(frozen=True)
class StoredTensor:
    """A tensor whose values are bytes of its torch.save archive as they lie: little-endian, C order."""

    data: memoryview
    dtype: int
    """``tensor_pb2.DataType`` (bfloat16 as raw bits, as on the wire)."""
    shape: tuple[int, ...]


def stored_tensor(data: bytes | memoryview, *, max_bytes: int, field: str,
                  cap_name: str = DEFAULT_CAP_NAME) -> StoredTensor | None:
    """The tensor of ``torch.save(tensor)`` bytes as a view of them, when its values lie there as a wire tensor's
    would: a little-endian storage that the tensor covers whole, from its start, in C order, not
    negated — what ``torch.save`` of a contiguous tensor writes. None otherwise (``decode_torch_save`` then gives the
    values). A broken or unsafe file raises the same ``InvalidArgument`` as ``decode_torch_save``; the view's values
    are not checked here (NaN/Inf, shape against a model: the caller's rules, as for any wire tensor)."""
    p = _parse_torch_save(data, max_bytes, field, cap_name)
    obj = p.obj
    if p.count == 0 or obj.negated or obj.offset != 0 or obj.storage.numel != p.count:
        return None
    contiguous: list[int] = []
    step = 1
    for d in reversed(obj.size):
        contiguous.append(step if d > 1 else 0)
        step *= d
    if tuple(reversed(contiguous)) != p.strides:
        return None
    if _byteorder(p.archive, p.prefix, field) != "little":
        return None
    view = _read_storage(p.archive, data, p.storage_name, p.count * p.np_dtype.itemsize, field)
    return StoredTensor(memoryview(view).cast("B"), p.dtype, tuple(int(d) for d in obj.size))


def _checked_strides(obj: _TensorRef, count: int, field: str) -> tuple[int, ...]:
    """The strides to hand numpy: every element the view addresses lies inside the storage.

    Called after the shape and the storage passed the cap, so each stride kept is below the storage's element
    count and its byte stride cannot overflow. Strides of dimensions of size 0 or 1 address nothing: they become 0.
    """
    numel = obj.storage.numel
    if any(s > _MAX_STRIDE for s in obj.stride):
        raise _bad(field, "BAD_STRIDES", f"strides {format_dims(obj.stride)} are not 64-bit integers; {_DENSE_HINT}")
    if obj.offset > numel:
        raise _bad(field, "NOT_A_TENSOR",
                   f"storage offset {obj.offset} is past the end of the {numel}-element storage (truncated file?)")
    if count == 0:
        return (0,) * len(obj.size)
    last = obj.offset + sum((d - 1) * s for d, s in zip(obj.size, obj.stride, strict=True))
    if last >= numel:
        if obj.offset + count > numel:  # even a dense layout would not fit: the storage is short
            raise _bad(field, "NOT_A_TENSOR",
                       f"shape {format_dims(obj.size)} at offset {obj.offset} needs {obj.offset + count} elements, "
                       f"but the storage holds {numel} (truncated or inconsistent file)")
        raise _bad(field, "BAD_STRIDES",
                   f"shape {format_dims(obj.size)} with strides {format_dims(obj.stride)} at offset {obj.offset} "
                   f"reaches element {last}, past the storage's {numel}; {_DENSE_HINT}")
    return tuple(s if d > 1 else 0 for d, s in zip(obj.size, obj.stride, strict=True))


def _read_storage(archive: zipfile.ZipFile, data: bytes, name: str, nbytes: int, field: str) -> memoryview | bytes:
    """The storage's bytes, exactly ``nbytes`` of them.

    torch.save stores entries uncompressed; those are viewed in place (no copy, and no CRC check: a flipped bit
    only changes values, which the validator still checks for NaN/Inf). A compressed entry is refused before a byte
    of it is inflated: its headers' sizes are claims, and DEFLATE turns ~1 MB into 1 GiB.
    """
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise _bad(field, "NOT_A_TENSOR", "storage entry missing from the archive (truncated file?)") from None
    # torch writes exactly nbytes per storage; insisting on it also bounds what a compressed entry can inflate to.
    if info.file_size != nbytes:
        raise _bad(field, "NOT_A_TENSOR",
                   f"storage holds {info.file_size} bytes but the tensor header needs {nbytes} (truncated file?)")
    if info.compress_type != zipfile.ZIP_STORED:
        raise _bad(field, "COMPRESSED_ENTRY", _COMPRESSED)
    start = info.header_offset
    local = bytes(data[start:start + 30])
    if len(local) == 30 and local[:4] == _ZIP_MAGIC:
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        begin = start + 30 + name_len + extra_len
        if begin + nbytes <= len(data):
            return memoryview(data)[begin:begin + nbytes]
    raise _bad(field, "NOT_A_TENSOR", "storage entry runs past the end of the file (truncated file?)")


def _read_small_entry(archive: zipfile.ZipFile, name: str, limit: int, field: str) -> bytes:
    """An archive entry of at most ``limit`` bytes, read through a stream that stops at ``limit + 1``.

    The zip headers' sizes are claims: ``ZipFile.read`` inflates a DEFLATE stream whole before comparing it with
    them, so a 1 KB entry can allocate gigabytes. Reading at most one byte past the limit bounds memory by the
    limit whatever the headers and the stream say. ``KeyError`` (no such entry) is left to the caller.
    """
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        raise _bad(field, "COMPRESSED_ENTRY", _COMPRESSED)
    if info.file_size > limit:
        raise _bad(field, "NOT_A_TENSOR", f"archive entry {name.rsplit('/', 1)[-1]!r} is larger than a single "
                                          f"tensor's ({limit} bytes at most)")
    try:
        with archive.open(name) as f:
            raw = f.read(limit + 1)
    except Exception as e:  # noqa: BLE001 - zlib.error, BadZipFile (CRC), EOFError...: the client's file is broken
        raise _bad(field, "NOT_A_TENSOR", f"archive entry unreadable ({type(e).__name__}); truncated or corrupted "
                                          f"file") from None
    if len(raw) > limit:
        raise _bad(field, "NOT_A_TENSOR", f"archive entry {name.rsplit('/', 1)[-1]!r} holds more than its header "
                                          f"declares (a forged archive)")
    return raw


def _byteorder(archive: zipfile.ZipFile, prefix: str, field: str) -> str:
    try:
        raw = _read_small_entry(archive, f"{prefix}byteorder", _MAX_BYTEORDER_BYTES, field)
    except KeyError:
        return "little"  # archives from before torch recorded it were all little-endian
    order = raw.strip().decode("ascii", "replace")
    if order not in ("little", "big"):
        raise _bad(field, "NOT_A_TENSOR", f"unknown byteorder record {order[:16]!r} in the archive")
    return order


def _negate(out: np.ndarray, dtype: int, field: str) -> None:
    if dtype == tensor_pb2.DATA_TYPE_BF16:
        out ^= np.uint16(0x8000)  # flip the sign bit, as negation of a bf16 does
    elif dtype == tensor_pb2.DATA_TYPE_BOOL:
        raise _bad(field, "NOT_A_TENSOR", "a bool tensor cannot carry a negation bit")
    else:
        np.negative(out, out=out)


# --- safetensors ------------------------------------------------------------------------------------------------


def decode_safetensors(data: bytes, *, max_bytes: int, field: str,
                       cap_name: str = DEFAULT_CAP_NAME) -> tuple[np.ndarray, int]:
    """Decode a safetensors file holding exactly one tensor."""
    if len(data) < 8:
        raise _bad(field, "NOT_A_TENSOR", "safetensors file shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8 or n > _MAX_SAFETENSORS_HEADER:
        raise _bad(field, "NOT_A_TENSOR", "safetensors header length runs past the end of the file")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (ValueError, RecursionError):
        raise _bad(field, "NOT_A_TENSOR", "safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _bad(field, "NOT_A_TENSOR", "safetensors header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(entries) != 1:
        raise _bad(field, "NOT_A_TENSOR", f"safetensors file holds {len(entries)} tensors; send exactly one")
    (meta,) = entries.values()
    if not isinstance(meta, dict):
        raise _bad(field, "NOT_A_TENSOR", "safetensors tensor entry is not an object")
    kind, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(kind, str) or kind not in _SAFETENSORS_DTYPES:
        raise _bad(field, "UNSUPPORTED_DTYPE", f"safetensors dtype {str(kind)[:16]!r} is not supported; send F32, "
                                               f"F16, BF16 or F64")
    if (not isinstance(shape, list) or not all(_is_index(d) for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(o) for o in offsets)):
        raise _bad(field, "NOT_A_TENSOR", "safetensors shape or data_offsets malformed")
    np_dtype, dtype = _SAFETENSORS_DTYPES[kind]
    count = check_shape(shape, field)
    nbytes = count * np_dtype.itemsize
    check_cap(field, nbytes, max_bytes, cap_name=cap_name)
    begin, end = offsets
    if end - begin != nbytes or end > len(data) - 8 - n:
        raise _bad(field, "NOT_A_TENSOR",
                   f"safetensors data_offsets {format_dims(offsets)} do not match shape {format_dims(shape)} of "
                   f"{kind} and the {len(data) - 8 - n}-byte body")
    arr = np.frombuffer(data, dtype=np_dtype, count=count, offset=8 + n + begin).reshape(shape)
    return arr.copy(), dtype

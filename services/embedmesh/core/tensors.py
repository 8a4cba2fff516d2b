"""``embedmesh.tensor.v1.Tensor`` <-> numpy, with no copies where numpy allows and no torch.

bfloat16 has no numpy dtype: it is carried as its raw uint16 bit pattern (``BF16_STORAGE``) and widened to
float32 by a shift when a computation needs values. Element size and byte count are checked before any
array is built, so a lying header cannot make us allocate.

Shape rules, shared with ``tensor_codec`` (``check_shape``), each an InvalidArgument naming the field:
- at most ``MAX_RANK`` (8) dimensions (BAD_RANK); prompt embeddings need 3 at most, the rest is headroom for
  generic tensors such as encoder-cache uploads, and numpy itself stops at 64
- every dimension in ``[0, MAX_DIM]`` (INVALID_SHAPE)
Element counts are exact Python ints computed only after both rules hold, so no product of dimensions can
overflow a 64-bit integer before it is compared with a byte length or a cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embedmesh.core.errors import InvalidArgument
from embedmesh.tensor.v1 import tensor_pb2

__all__ = [
    "DType",
    "DTypeInfo",
    "DTYPES",
    "BF16_STORAGE",
    "DTYPE_NAMES",
    "dtype_from_name",
    "to_numpy",
    "from_numpy",
    "bf16_to_f32",
    "f32_to_bf16",
    "element_size",
    "numpy_dtype",
    "is_float",
    "float_storage_dtypes",
    "check_shape",
    "format_dims",
    "MAX_RANK",
    "MAX_DIM",
]

DType = int  # a tensor_pb2.DataType value

BF16_STORAGE = np.dtype("<u2")

MAX_RANK = 8
"""Most dimensions a tensor may have on the wire (prompt embeddings: 2 or 3; numpy's own limit is 64)."""
MAX_DIM = 1 << 31
"""Largest single dimension. With at most MAX_RANK of them every element count is an exact int far below what
Python handles, and it is checked against the data length or a byte cap before numpy sees the shape."""


@dataclass(frozen=True)
class DTypeInfo:
    """One entry of the dtype vocabulary: every name a DataType goes by in the formats the mesh reads."""

    name: str
    """torch's name without ``torch.`` (``"bfloat16"``): messages, ``GetInfo.dtype``, config values."""
    numpy: np.dtype
    """Storage dtype (little-endian; bf16 as its uint16 bits)."""
    is_float: bool
    torch_storage: str
    """The typed storage class ``torch.save`` names in ``data.pkl`` (``"BFloat16Storage"``)."""
    safetensors: str
    """The safetensors header's dtype code (``"BF16"``)."""


DTYPES: dict[int, DTypeInfo] = {
    tensor_pb2.DATA_TYPE_BOOL: DTypeInfo("bool", np.dtype("?"), False, "BoolStorage", "BOOL"),
    tensor_pb2.DATA_TYPE_UINT8: DTypeInfo("uint8", np.dtype("u1"), False, "ByteStorage", "U8"),
    tensor_pb2.DATA_TYPE_INT8: DTypeInfo("int8", np.dtype("i1"), False, "CharStorage", "I8"),
    tensor_pb2.DATA_TYPE_INT16: DTypeInfo("int16", np.dtype("<i2"), False, "ShortStorage", "I16"),
    tensor_pb2.DATA_TYPE_INT32: DTypeInfo("int32", np.dtype("<i4"), False, "IntStorage", "I32"),
    tensor_pb2.DATA_TYPE_INT64: DTypeInfo("int64", np.dtype("<i8"), False, "LongStorage", "I64"),
    tensor_pb2.DATA_TYPE_FP16: DTypeInfo("float16", np.dtype("<f2"), True, "HalfStorage", "F16"),
    tensor_pb2.DATA_TYPE_BF16: DTypeInfo("bfloat16", BF16_STORAGE, True, "BFloat16Storage", "BF16"),
    tensor_pb2.DATA_TYPE_FP32: DTypeInfo("float32", np.dtype("<f4"), True, "FloatStorage", "F32"),
    tensor_pb2.DATA_TYPE_FP64: DTypeInfo("float64", np.dtype("<f8"), True, "DoubleStorage", "F64"),
}
"""The one dtype vocabulary: DataType -> its names and storage. ``tensor_codec`` reads torch.save and safetensors
through it, the worker its accepted row dtypes; nothing else spells a dtype table."""
_INFO = DTYPES

DTYPE_NAMES: dict[int, str] = {k: v.name for k, v in _INFO.items()}
_BY_NAME = {v.name: k for k, v in _INFO.items()}


def dtype_from_name(name: str) -> DType:
    """``"float32"`` (or torch's ``"torch.float32"``) -> DataType value."""
    key = name.removeprefix("torch.")
    if key not in _BY_NAME:
        raise ValueError(f"unknown dtype {name!r}")
    return _BY_NAME[key]


def numpy_dtype(dtype: DType) -> np.dtype:
    """Storage dtype of a DataType (uint16 bits for bf16)."""
    return _INFO[dtype].numpy


def element_size(dtype: DType) -> int:
    return _INFO[dtype].numpy.itemsize


def is_float(dtype: DType) -> bool:
    return dtype in _INFO and _INFO[dtype].is_float


def float_storage_dtypes() -> tuple[np.dtype, ...]:
    """The numpy dtypes that hold float rows (float16/32/64, and uint16 for bf16 bits)."""
    return tuple(i.numpy for i in DTYPES.values() if i.is_float)


def _num(v: int) -> str:
    # Only for messages: str() of a 5000-digit int raises ValueError in Python >= 3.11.
    return str(v) if -(10**20) < v < 10**20 else f"{'-' if v < 0 else ''}~2**{abs(v).bit_length() - 1}"


def format_dims(dims: Sequence[int], limit: int = MAX_RANK) -> str:
    """A shape or strides for an error message: huge values as powers of two, long lists cut."""
    shown = ", ".join(_num(d) for d in list(dims[:limit]))
    return f"[{shown}{f', ... ({len(dims)} dims)' if len(dims) > limit else ''}]"


MAX_SHAPE_PRODUCT = 2**62
"""Largest product of a shape's non-zero dimensions (numpy cannot form a shape past its index range, even empty)."""


def check_shape(shape: Sequence[int], field: str) -> int:
    """Refuse a shape with more than MAX_RANK dimensions (BAD_RANK) or a dimension outside ``[0, MAX_DIM]``
    (INVALID_SHAPE); return the exact element count. ``shape`` holds ints (callers check types first)."""
    if len(shape) > MAX_RANK:
        raise InvalidArgument(
            f"{field}: {len(shape)} dimensions; a tensor may have at most {MAX_RANK} (prompt embeddings: 2 or 3)",
            field=field, reason="BAD_RANK")
    for d in shape:
        if not 0 <= d <= MAX_DIM:
            raise InvalidArgument(
                f"{field}: every dimension must be in [0, 2**31], got shape {format_dims(shape)}",
                field=field, reason="INVALID_SHAPE")
    count = 1
    nonzero = 1
    for d in shape:
        count *= d  # at most (2**31)**8: exact, and no 64-bit product is ever formed
        nonzero *= d or 1
    if count == 0 and nonzero > MAX_SHAPE_PRODUCT:
        # An empty tensor whose other dimensions multiply past what numpy can index: numpy refuses even to make
        # the empty array of that shape, so the shape is refused here, by name.
        raise InvalidArgument(
            f"{field}: the non-zero dimensions multiply to more than 2**62, got shape {format_dims(shape)}",
            field=field, reason="INVALID_SHAPE")
    return count


def to_numpy(msg: tensor_pb2.Tensor, *, field: str = "tensor",
             data: memoryview | None = None) -> tuple[np.ndarray, DType]:
    """View a Tensor message's bytes as an array (bf16 as its uint16 bits). Checks dtype, shape and length.
    ``data``: the tensor's bytes when they travelled apart from the message (cut out of the received buffer or sent
    after it, ``core.transport``): viewed, not copied; used unless the message carries bytes of its own."""
    info = _INFO.get(msg.dtype)
    if info is None:
        raise InvalidArgument(f"{field}.dtype: unsupported data type {msg.dtype}", field=f"{field}.dtype",
                              reason="UNSUPPORTED_DTYPE")
    shape = tuple(int(d) for d in msg.shape)
    count = check_shape(shape, f"{field}.shape")
    expected = count * info.numpy.itemsize
    if data is None or len(msg.data):
        data = msg.data  # read once: each read of a bytes field copies
    if len(data) != expected:
        raise InvalidArgument(
            f"{field}.data: {len(data)} bytes but shape {format_dims(shape)} of {info.name} needs "
            f"{_num(expected)}",
            field=f"{field}.data",
            reason="DATA_SIZE_MISMATCH",
        )
    arr = np.frombuffer(data, dtype=info.numpy).reshape(shape)
    return arr, msg.dtype


def from_numpy(arr: np.ndarray, dtype: DType | None = None) -> tensor_pb2.Tensor:
    """Array -> Tensor message. Pass ``dtype=DATA_TYPE_BF16`` for a uint16 array of bf16 bits."""
    if dtype is None:
        for key, info in _INFO.items():
            if info.numpy == arr.dtype.newbyteorder("<") and key != tensor_pb2.DATA_TYPE_BF16:
                dtype = key
                break
        else:
            raise ValueError(f"no Tensor dtype for numpy {arr.dtype}")
    target = _INFO[dtype].numpy
    data = np.ascontiguousarray(arr, dtype=target)
    return tensor_pb2.Tensor(dtype=dtype, shape=list(data.shape), data=data.tobytes())


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32 exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Narrow float32 to bf16 bits with round-to-nearest-even, as torch does (NaN stays NaN)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out

"""``embedmesh.tensor.v1.Tensor`` <-> numpy, with no copies where numpy allows and no torch.

bfloat16 has no numpy dtype: it is carried as its raw uint16 bit pattern (``BF16_STORAGE``) and widened to
float32 by a shift when a computation needs values. Element size and byte count are checked before any
array is built, so a lying header cannot make us allocate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedmesh.core.errors import InvalidArgument
from embedmesh.tensor.v1 import tensor_pb2

__all__ = [
    "DType",
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
]

DType = int  # a tensor_pb2.DataType value

BF16_STORAGE = np.dtype("<u2")


@dataclass(frozen=True)
class _Info:
    name: str
    numpy: np.dtype
    is_float: bool


_INFO: dict[int, _Info] = {
    tensor_pb2.DATA_TYPE_BOOL: _Info("bool", np.dtype("?"), False),
    tensor_pb2.DATA_TYPE_UINT8: _Info("uint8", np.dtype("u1"), False),
    tensor_pb2.DATA_TYPE_INT8: _Info("int8", np.dtype("i1"), False),
    tensor_pb2.DATA_TYPE_INT16: _Info("int16", np.dtype("<i2"), False),
    tensor_pb2.DATA_TYPE_INT32: _Info("int32", np.dtype("<i4"), False),
    tensor_pb2.DATA_TYPE_INT64: _Info("int64", np.dtype("<i8"), False),
    tensor_pb2.DATA_TYPE_FP16: _Info("float16", np.dtype("<f2"), True),
    tensor_pb2.DATA_TYPE_BF16: _Info("bfloat16", BF16_STORAGE, True),
    tensor_pb2.DATA_TYPE_FP32: _Info("float32", np.dtype("<f4"), True),
    tensor_pb2.DATA_TYPE_FP64: _Info("float64", np.dtype("<f8"), True),
}

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


def to_numpy(msg: tensor_pb2.Tensor, *, field: str = "tensor") -> tuple[np.ndarray, DType]:
    """View a Tensor message's bytes as an array (bf16 as its uint16 bits). Checks dtype, shape and length."""
    info = _INFO.get(msg.dtype)
    if info is None:
        raise InvalidArgument(f"{field}.dtype: unsupported data type {msg.dtype}", field=f"{field}.dtype",
                              reason="UNSUPPORTED_DTYPE")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape: dimensions must be >= 0, got {list(shape)}", field=f"{field}.shape",
                              reason="INVALID_SHAPE")
    count = 1
    for d in shape:
        count *= d
    expected = count * info.numpy.itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(
            f"{field}.data: {len(msg.data)} bytes but shape {list(shape)} of {info.name} needs {expected}",
            field=f"{field}.data",
            reason="DATA_SIZE_MISMATCH",
        )
    arr = np.frombuffer(msg.data, dtype=info.numpy).reshape(shape)
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

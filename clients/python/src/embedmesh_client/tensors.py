"""numpy arrays and torch tensors <-> the ``Tensor`` message, without copies where the layout allows.

bfloat16 travels as its raw 16-bit patterns: a torch bfloat16 tensor is viewed as int16 (no copy); a numpy array
has no bfloat16, so pass ``dtype="bfloat16"`` with a uint16 array of the bit patterns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["to_tensor", "tensor_parts", "from_tensor"]

_NUMPY = {
    np.dtype("<f4"): tensor_pb2.DATA_TYPE_FP32,
    np.dtype("<f2"): tensor_pb2.DATA_TYPE_FP16,
    np.dtype("<f8"): tensor_pb2.DATA_TYPE_FP64,
    np.dtype("<i4"): tensor_pb2.DATA_TYPE_INT32,
    np.dtype("<i8"): tensor_pb2.DATA_TYPE_INT64,
}
_BACK = {v: k for k, v in _NUMPY.items()} | {tensor_pb2.DATA_TYPE_BF16: np.dtype("<u2")}


def _as_numpy(value: Any) -> tuple[np.ndarray, int | None]:
    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), tensor_pb2.DATA_TYPE_BF16
        return t.numpy(), None
    return np.asarray(value), None


def to_tensor(value: Any, dtype: str | None = None) -> tensor_pb2.Tensor:
    """A numpy array or torch tensor as a ``Tensor`` message (row-major, little-endian)."""
    head, data = tensor_parts(value, dtype)
    head.data = data.tobytes()
    return head


def tensor_parts(value: Any, dtype: str | None = None) -> tuple[tensor_pb2.Tensor, memoryview]:
    """``to_tensor`` without ``data``, and those bytes as a view (of the array itself when its layout allows): the
    head of a tensor whose bytes are sent in pieces after it."""
    arr, forced = _as_numpy(value)
    if dtype == "bfloat16":
        forced = tensor_pb2.DATA_TYPE_BF16
        arr = arr.astype("<u2", copy=False)
    if forced is None:
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        if arr.dtype not in _NUMPY:
            raise TypeError(f"unsupported dtype {arr.dtype}; use float32, float16, float64 or bfloat16")
        forced = _NUMPY[arr.dtype]
    arr = np.ascontiguousarray(arr)
    return tensor_pb2.Tensor(dtype=forced, shape=list(arr.shape)), memoryview(arr).cast("B")


def from_tensor(msg: tensor_pb2.Tensor) -> np.ndarray:
    """A ``Tensor`` message as a numpy array (bf16 as uint16 bit patterns)."""
    return np.frombuffer(msg.data, dtype=_BACK[msg.dtype]).reshape(tuple(msg.shape))

"""``tensors.to_numpy`` and ``check_shape``: hostile Tensor protos (absurd rank, dimensions past 2**31 or mixing 0
with 2**63, negative dimensions) are InvalidArgument naming the field and the rule, never a numpy error."""

from __future__ import annotations

import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.tensor.v1 import tensor_pb2 as T  # noqa: N812

F32 = T.DATA_TYPE_FP32


@pytest.mark.parametrize(("shape", "data", "field", "reason"), [
    ([1] * 71, b"\0" * 4, "t.shape", "BAD_RANK"),
    ([1] * 9, b"\0" * 4, "t.shape", "BAD_RANK"),
    ([0, 2**63 - 1], b"", "t.shape", "INVALID_SHAPE"),
    ([2**32, 2**32], b"", "t.shape", "INVALID_SHAPE"),
    ([2**31, 2**31, 2**31], b"", "t.data", "DATA_SIZE_MISMATCH"),  # product past 2**64: exact, then compared
    ([-1, 4], b"", "t.shape", "INVALID_SHAPE"),
    ([-(2**63)], b"", "t.shape", "INVALID_SHAPE"),
    ([2, 3], b"\0" * 20, "t.data", "DATA_SIZE_MISMATCH"),
    ([0, 3, 2**31 - 1, 2**31 - 1], b"", "t.shape", "INVALID_SHAPE"),  # empty, but numpy cannot form the shape
], ids=["71 dims", "9 dims", "0 and int64 max", "2**32 dims", "product past 2**64", "negative", "int64 min",
        "short data", "empty, rest past 2**62"])
def test_hostile_protos_are_refused(shape: list[int], data: bytes, field: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        tensors.to_numpy(T.Tensor(dtype=F32, shape=shape, data=data), field="t")
    assert info.value.field == field and info.value.reason == reason
    assert info.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize("shape", [[0, 2**31], [1] * 8, [], [3, 2]], ids=["empty 2**31", "8 dims", "scalar", "2-D"])
def test_edge_shapes_convert(shape: list[int]) -> None:
    count = int(np.prod(shape, dtype=object)) if shape else 1
    arr, dtype = tensors.to_numpy(T.Tensor(dtype=F32, shape=shape, data=np.arange(count, dtype="<f4").tobytes()))
    assert dtype == F32 and arr.shape == tuple(shape)
    assert np.array_equal(arr.ravel(), np.arange(count, dtype=np.float32))


def test_check_shape_counts_exactly_and_messages_stay_short() -> None:
    assert tensors.check_shape([2**31] * 8, "x") == 2**248
    with pytest.raises(InvalidArgument) as info:
        tensors.check_shape([0, 10**5000], "x")
    assert "~2**16609" in info.value.message and len(info.value.message) < 200
    with pytest.raises(InvalidArgument) as info:
        tensors.check_shape([1] * 10_000, "x")
    assert "10000 dimensions" in info.value.message and len(info.value.message) < 200


def test_one_dtype_vocabulary_feeds_the_codec_and_the_worker() -> None:
    """Every DataType has one entry, and the torch.save / safetensors tables are read from it (no second table)."""
    from embedmesh.core import tensor_codec
    from embedmesh.services.worker.validate import _ROW_DTYPES

    assert set(tensors.DTYPES) == set(tensors.DTYPE_NAMES)
    for key, info in tensors.DTYPES.items():
        assert tensor_codec._STORAGES[info.torch_storage] == (info.numpy, key)
        assert tensor_codec._SAFETENSORS_DTYPES[info.safetensors] == (info.numpy, key)
        assert tensors.dtype_from_name(info.name) == key
        assert tensors.dtype_from_name(f"torch.{info.name}") == key
    assert tensor_codec._STORAGES["BFloat16Storage"] == (tensors.BF16_STORAGE, T.DATA_TYPE_BF16)
    assert set(_ROW_DTYPES) == {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
                                np.dtype(np.uint16)}

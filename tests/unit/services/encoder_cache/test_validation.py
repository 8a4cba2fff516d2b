"""encoder_cache.validation: what ``Put`` refuses before storing — each rule with its field, reason and message —
and the TTL range."""

from __future__ import annotations

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensors import f32_to_bf16
from embedmesh.services.encoder_cache.validation import all_finite, check_ttl, check_upload
from embedmesh.tensor.v1 import tensor_pb2 as T  # noqa: N812

FP32, FP16, BF16, FP64 = T.DATA_TYPE_FP32, T.DATA_TYPE_FP16, T.DATA_TYPE_BF16, T.DATA_TYPE_FP64


@pytest.mark.parametrize("arr,dtype", [
    (np.ones((3, 8), np.float32), FP32),
    (np.ones((1, 3, 8), np.float16), FP16),
    (np.ones((2, 4), np.float64), FP64),
    (f32_to_bf16(np.ones((2, 4), np.float32)), BF16),
    (np.ones((1, 1), np.float32), FP32),
])
def test_usable_uploads_pass(arr: np.ndarray, dtype: int) -> None:
    check_upload(arr, dtype, field="tensor")


def _refusal(arr: np.ndarray, dtype: int, **kw: str) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        check_upload(arr, dtype, **{"field": "tensor", **kw})
    return info.value


def test_integer_dtypes_are_refused_naming_the_dtype_field() -> None:
    e = _refusal(np.ones((2, 4), np.int32), T.DATA_TYPE_INT32, dtype_field="dtype")
    assert (e.field, e.reason) == ("dtype", "UNSUPPORTED_DTYPE")
    assert e.message.startswith("dtype: dtype ") and "is not accepted; upload float32, float16, bfloat16 or " \
        "float64 embeddings" in e.message
    assert _refusal(np.ones((2, 4), np.int32), T.DATA_TYPE_INT32).field == "tensor"  # no separate field: the tensor


def test_a_batch_of_several_prompts_is_refused() -> None:
    e = _refusal(np.ones((2, 3, 8), np.float32), FP32, shape_field="shape")
    assert (e.field, e.reason) == ("shape", "BATCH_NOT_ONE")
    assert e.message == ("shape: a 3-D tensor must be (1, num_tokens, hidden_size), got shape [2, 3, 8]; upload one "
                         "prompt per tensor")


@pytest.mark.parametrize("shape", [(8,), (1, 1, 2, 8), ()])
def test_other_ranks_are_refused(shape: tuple[int, ...]) -> None:
    e = _refusal(np.ones(shape, np.float32), FP32)
    assert (e.field, e.reason) == ("tensor", "BAD_RANK")
    assert f"got {len(shape)}-D shape" in e.message


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (1, 0, 8)])
def test_empty_tensors_are_refused(shape: tuple[int, ...]) -> None:
    e = _refusal(np.ones(shape, np.float32), FP32)
    assert (e.field, e.reason) == ("tensor", "EMPTY_EMBEDS")
    assert f"shape {list(shape)} holds no rows" in e.message


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [FP32, FP16, FP64, BF16])
def test_non_finite_values_are_refused_in_every_dtype(bad: float, dtype: int) -> None:
    base = np.ones((2, 4), np.float32)
    base[1, 2] = bad
    arr = {FP32: base, FP16: base.astype(np.float16), FP64: base.astype(np.float64), BF16: f32_to_bf16(base)}[dtype]
    assert not all_finite(arr, dtype)
    e = _refusal(arr, dtype, shape_field="shape", dtype_field="dtype")
    assert (e.field, e.reason) == ("tensor", "NON_FINITE")
    assert "contains NaN or Inf values" in e.message


def test_bf16_finiteness_reads_the_exponent_bits() -> None:
    bits = f32_to_bf16(np.array([[1.0, -2.0, 3.0e38, -3.0e38]], np.float32))
    assert all_finite(bits, BF16)
    assert not all_finite(np.array([[0x7F80]], np.uint16), BF16)  # +Inf
    assert not all_finite(np.array([[0xFFC1]], np.uint16), BF16)  # a NaN


def test_ttl_range() -> None:
    assert check_ttl(1, 86400) == 1 and check_ttl(86400, 86400) == 86400
    for bad in (0, -5, 86401):
        with pytest.raises(InvalidArgument) as info:
            check_ttl(bad, 86400)
        assert (info.value.field, info.value.reason) == ("ttl_seconds", "OUT_OF_RANGE")
        assert info.value.message == f"ttl_seconds: must be between 1 and 86400 seconds (1 days), got {bad}"
    with pytest.raises(InvalidArgument) as info:
        check_ttl(0, 3600, field="cache.ttl")
    assert info.value.field == "cache.ttl"

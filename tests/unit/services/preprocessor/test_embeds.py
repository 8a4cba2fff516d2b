"""Validation rules of prompt embeddings against the model: one table of bad tensors, each naming the field and
the rule, and the casts that good tensors go through (checked against torch's own casts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensors import bf16_to_f32, f32_to_bf16
from embedmesh.services.preprocessor.embeds import ModelSpec, decode_prompt_embeds, validate_embeds
from embedmesh.tensor.v1 import tensor_pb2 as T  # noqa: N812 - T.DATA_TYPE_* reads well in tables

FP32 = ModelSpec(hidden_size=8, max_context_tokens=32, dtype=T.DATA_TYPE_FP32)
BF16 = ModelSpec(hidden_size=8, max_context_tokens=32, dtype=T.DATA_TYPE_BF16)


def good(rows: int = 3, dtype: str = "<f4") -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, 8)).astype(dtype)


def with_value(v: float, dtype: str = "<f4") -> np.ndarray:
    a = good(dtype=dtype)
    a[1, 2] = v
    return a


BAD = [
    ("1-D", good()[0], T.DATA_TYPE_FP32, "BAD_RANK"),
    ("4-D", good()[None, None], T.DATA_TYPE_FP32, "BAD_RANK"),
    ("batch of two", np.stack([good(), good()]), T.DATA_TYPE_FP32, "BATCH_NOT_ONE"),
    ("wrong hidden", np.zeros((3, 9), np.float32), T.DATA_TYPE_FP32, "HIDDEN_SIZE_MISMATCH"),
    ("int32", np.zeros((3, 8), np.int32), T.DATA_TYPE_INT32, "UNSUPPORTED_DTYPE"),
    ("int64", np.zeros((3, 8), np.int64), T.DATA_TYPE_INT64, "UNSUPPORTED_DTYPE"),
    ("bool", np.zeros((3, 8), bool), T.DATA_TYPE_BOOL, "UNSUPPORTED_DTYPE"),
    ("NaN", with_value(float("nan")), T.DATA_TYPE_FP32, "NON_FINITE"),
    ("+Inf", with_value(float("inf")), T.DATA_TYPE_FP32, "NON_FINITE"),
    ("-Inf", with_value(float("-inf")), T.DATA_TYPE_FP32, "NON_FINITE"),
    ("float64 overflowing float32", with_value(1e300, "<f8"), T.DATA_TYPE_FP64, "NON_FINITE"),
    ("zero rows", np.zeros((0, 8), np.float32), T.DATA_TYPE_FP32, "EMPTY_EMBEDS"),
    ("rows + max_tokens over context", good(30), T.DATA_TYPE_FP32, "CONTEXT_OVERFLOW"),
]


@pytest.mark.parametrize("name,arr,dtype,reason", BAD, ids=[b[0] for b in BAD])
def test_rule_violations_name_field_and_rule(name: str, arr: np.ndarray, dtype: int, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_embeds(arr, dtype, FP32, field="prompt_embeds[1]", max_tokens=4)
    assert info.value.field == "prompt_embeds[1]"
    assert info.value.reason == reason
    assert info.value.message.startswith("prompt_embeds[1]: ")


def test_context_message_gives_the_numbers() -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_embeds(good(30), T.DATA_TYPE_FP32, FP32, field="prompt_embeds", max_tokens=4)
    assert "30" in info.value.message and "32" in info.value.message


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float64, torch.float32])
def test_float_inputs_are_cast_like_torch(src: torch.dtype) -> None:
    t = torch.randn(3, 8, dtype=torch.float64).to(src)
    if src == torch.bfloat16:
        arr, dtype = f32_to_bf16(t.float().numpy()), T.DATA_TYPE_BF16
    else:
        arr = t.numpy()
        dtype = {torch.float16: T.DATA_TYPE_FP16, torch.float64: T.DATA_TYPE_FP64,
                 torch.float32: T.DATA_TYPE_FP32}[src]
    out32 = validate_embeds(arr, dtype, FP32, field="f", max_tokens=1)
    assert out32.dtype == np.float32 and out32.flags.c_contiguous
    assert np.array_equal(out32, t.to(torch.float32).numpy())
    out16 = validate_embeds(arr, dtype, BF16, field="f", max_tokens=1)
    assert out16.dtype == np.uint16
    assert np.array_equal(bf16_to_f32(out16), t.to(torch.bfloat16).float().numpy())


def test_three_d_is_squeezed() -> None:
    out = validate_embeds(good()[None], T.DATA_TYPE_FP32, FP32, field="f", max_tokens=1)
    assert out.shape == (3, 8)


def test_raw_array_over_cap_is_refused_before_validation() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_prompt_embeds(array=good(), dtype=T.DATA_TYPE_FP32, spec=FP32, field="prompt_embeds", max_tokens=1,
                             max_bytes=64)
    assert info.value.reason == "TOO_LARGE"

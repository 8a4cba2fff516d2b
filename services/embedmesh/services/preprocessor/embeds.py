"""Validation of prompt embeddings against the served model (DESIGN.md, "Prompt embeddings").

Rules, each an InvalidArgument naming the field and the rule (reason in parentheses):
- 2-D ``(N, hidden)`` or 3-D ``(1, N, hidden)`` (BAD_RANK, BATCH_NOT_ONE)
- ``hidden`` equals the model's hidden size (HIDDEN_SIZE_MISMATCH)
- floating dtype only; integers, bool and complex are refused by name (UNSUPPORTED_DTYPE)
- N >= 1 (EMPTY_EMBEDS) and N + max_tokens <= the model's context (CONTEXT_OVERFLOW)
- no NaN or Inf, checked after the cast to the model dtype too, so a float64 1e300 that overflows is caught
  (NON_FINITE)
- decoded size at most the configured cap (TOO_LARGE, checked before allocation by the codec)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import check_cap, decode_tensor_bytes
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["ModelSpec", "validate_embeds", "decode_prompt_embeds"]


@dataclass(frozen=True)
class ModelSpec:
    """What prompt embeddings must match."""

    hidden_size: int
    max_context_tokens: int
    dtype: int
    """DataType the model computes in (FP32, FP16 or BF16)."""


def _to_f32(arr: np.ndarray, dtype: int) -> np.ndarray:
    if dtype == tensor_pb2.DATA_TYPE_BF16:
        return tensors.bf16_to_f32(arr)
    return arr


def validate_embeds(arr: np.ndarray, dtype: int, spec: ModelSpec, *, field: str, max_tokens: int) -> np.ndarray:
    """Check every rule and return a C-contiguous ``(N, hidden)`` array in the model dtype (bf16 as uint16 bits)."""
    name = tensors.DTYPE_NAMES.get(dtype, f"type {dtype}")
    if not tensors.is_float(dtype):
        raise InvalidArgument(
            f"{field}: dtype {name} is not accepted; send float32, float16, bfloat16 or float64 embeddings",
            field=field, reason="UNSUPPORTED_DTYPE",
        )
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise InvalidArgument(
                f"{field}: a 3-D tensor must be (1, num_tokens, hidden_size), got shape {list(arr.shape)}; "
                f"send one prompt per tensor",
                field=field, reason="BATCH_NOT_ONE",
            )
        arr = arr[0]
    if arr.ndim != 2:
        raise InvalidArgument(
            f"{field}: expected a 2-D (num_tokens, hidden_size) or 3-D (1, num_tokens, hidden_size) tensor, "
            f"got {arr.ndim}-D shape {list(arr.shape)}",
            field=field, reason="BAD_RANK",
        )
    rows, hidden = arr.shape
    if hidden != spec.hidden_size:
        raise InvalidArgument(
            f"{field}: hidden size {hidden} does not match the model's hidden size {spec.hidden_size}",
            field=field, reason="HIDDEN_SIZE_MISMATCH",
        )
    if rows < 1:
        raise InvalidArgument(f"{field}: the tensor has zero rows; at least one is required", field=field,
                              reason="EMPTY_EMBEDS")
    if rows + max_tokens > spec.max_context_tokens:
        raise InvalidArgument(
            f"{field}: {rows} rows + max_tokens {max_tokens} exceed the model's context of "
            f"{spec.max_context_tokens} positions",
            field=field, reason="CONTEXT_OVERFLOW",
        )
    values = _to_f32(arr, dtype)
    if not np.isfinite(values).all():
        raise InvalidArgument(f"{field}: the tensor contains NaN or Inf values", field=field, reason="NON_FINITE")
    out = _cast(arr, dtype, values, spec.dtype)
    if out is not arr and spec.dtype != dtype:
        check = _to_f32(out, spec.dtype)
        if not np.isfinite(check).all():
            raise InvalidArgument(
                f"{field}: values overflow the model dtype {tensors.DTYPE_NAMES[spec.dtype]} (NaN or Inf after "
                f"the cast)",
                field=field, reason="NON_FINITE",
            )
    return np.ascontiguousarray(out)


def _cast(arr: np.ndarray, dtype: int, values: np.ndarray, target: int) -> np.ndarray:
    if dtype == target:
        return arr
    if target == tensor_pb2.DATA_TYPE_BF16:
        return tensors.f32_to_bf16(values.astype(np.float32))
    if target == tensor_pb2.DATA_TYPE_FP16:
        with np.errstate(over="ignore"):
            return values.astype(np.float16)
    if target == tensor_pb2.DATA_TYPE_FP32:
        with np.errstate(over="ignore"):
            return values.astype(np.float32)
    return values.astype(np.float64)


def decode_prompt_embeds(
    *,
    encoded: bytes | None = None,
    array: np.ndarray | None = None,
    dtype: int = 0,
    spec: ModelSpec,
    field: str,
    max_tokens: int,
    max_bytes: int,
) -> np.ndarray:
    """Decode (serialized bytes) or take (a raw gRPC tensor) one prompt's embeddings, then validate them."""
    if encoded is not None:
        arr, dtype = decode_tensor_bytes(encoded, max_bytes=max_bytes, field=field)
    elif array is not None:
        check_cap(field, array.nbytes, max_bytes)
        arr = array
    else:
        raise InvalidArgument(f"{field}: no tensor given", field=field, reason="REQUIRED")
    return validate_embeds(arr, dtype, spec, field=field, max_tokens=max_tokens)

"""Validation of prompt embeddings against the served model (DESIGN.md, "Prompt embeddings").

Rules, each an InvalidArgument naming the field and the rule (reason in parentheses):
- 2-D ``(N, hidden)`` or 3-D ``(1, N, hidden)`` (BAD_RANK, BATCH_NOT_ONE)
- ``hidden`` equals the model's hidden size (HIDDEN_SIZE_MISMATCH)
- floating dtype only; integers, bool and complex are refused by name (UNSUPPORTED_DTYPE)
- N >= 1 (EMPTY_EMBEDS) and N + max_tokens <= the model's context (CONTEXT_OVERFLOW, ``core.context``)
- no NaN or Inf, checked on the values cast to the model dtype, so a float64 1e300 that overflows float32 is
  caught too (NON_FINITE); casts round as torch's ``.to(dtype)`` does, bf16 included
- decoded size at most the configured cap (TOO_LARGE, checked before allocation by the codec)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedmesh.core import tensors
from embedmesh.core.context import ROWS, check_context
from embedmesh.core.errors import InvalidArgument
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["ModelSpec", "validate_embeds", "check_finite"]


@dataclass(frozen=True)
class ModelSpec:
    """What prompt embeddings must match."""

    hidden_size: int
    max_context_tokens: int
    dtype: int
    """DataType the model computes in (FP32, FP16 or BF16)."""


def _all_finite(arr: np.ndarray, dtype: int) -> bool:
    if dtype == tensor_pb2.DATA_TYPE_BF16:
        return bool(((arr & 0x7F80) != 0x7F80).all())  # exponent all ones: Inf or NaN
    if arr.dtype.itemsize >= 4:
        # A finite sum proves every value finite (NaN and Inf never cancel out); one pass without the bool array,
        # about a third faster on rows cut out of a message (unaligned). Only a sum that overflowed, or a real
        # NaN/Inf, takes the exact scan.
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.add.reduce(arr, axis=None)):
                return True
    return bool(np.isfinite(arr).all())


def validate_embeds(arr: np.ndarray, dtype: int, spec: ModelSpec, *, field: str, max_tokens: int,
                    scanned: bool = False) -> np.ndarray:
    """Check every rule and return a C-contiguous ``(N, hidden)`` array in the model dtype (bf16 as uint16 bits).

    ``arr`` is what ``tensor_codec`` or ``tensors.to_numpy`` produced for ``dtype``; shape and dtype rules come
    first because they are cheap, the value scan last. The result may share memory with ``arr`` when no cast or
    copy is needed. ``scanned``: the values are in the model dtype and pass ``check_finite`` as they arrive
    (``core.transport.pieces``), so they are not scanned here (they may not have arrived yet).
    """
    name = tensors.DTYPE_NAMES.get(dtype, f"type {dtype}")
    if not tensors.is_float(dtype):
        raise InvalidArgument(
            f"{field}: dtype {name} is not accepted; send float32, float16, bfloat16 or float64 embeddings",
            field=field, reason="UNSUPPORTED_DTYPE",
        )
    if arr.dtype != tensors.numpy_dtype(dtype):
        raise ValueError(f"array of {arr.dtype} passed as {name}")  # a caller bug, not the client's
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
    check_context(rows, max_tokens, spec.max_context_tokens, field=field, wording=ROWS)
    if scanned:
        if dtype != spec.dtype:
            raise ValueError("scanned rows must already be in the model dtype")  # a caller bug
        return np.ascontiguousarray(arr)
    out = _cast(arr, dtype, spec.dtype)
    # NaN and Inf survive every cast, and overflow (float64 1e300 -> float32) turns into Inf: one scan of the
    # output covers both. The input is scanned again only to word the error.
    if not _all_finite(out, spec.dtype):
        if spec.dtype != dtype and _all_finite(arr, dtype):
            raise InvalidArgument(
                f"{field}: values overflow the model dtype {tensors.DTYPE_NAMES[spec.dtype]} (Inf after the cast "
                f"from {name})",
                field=field, reason="NON_FINITE",
            )
        raise InvalidArgument(f"{field}: the tensor contains NaN or Inf values", field=field, reason="NON_FINITE")
    return np.ascontiguousarray(out)


def check_finite(arr: np.ndarray, dtype: int, field: str) -> None:
    """The NaN/Inf rule for values already in the model dtype (``validate_embeds``' wording)."""
    if not _all_finite(arr, dtype):
        raise InvalidArgument(f"{field}: the tensor contains NaN or Inf values", field=field, reason="NON_FINITE")


def _cast(arr: np.ndarray, dtype: int, target: int) -> np.ndarray:
    """Round to the model dtype as torch's ``.to(dtype)`` does (bf16, and fp16 from fp64, via float32)."""
    if dtype == target:
        return arr
    values = tensors.bf16_to_f32(arr) if dtype == tensor_pb2.DATA_TYPE_BF16 else arr
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes Inf, reported by the caller
        if target == tensor_pb2.DATA_TYPE_BF16:
            return tensors.f32_to_bf16(values.astype(np.float32))
        if target == tensor_pb2.DATA_TYPE_FP16 and values.dtype == np.float64:
            # torch casts float64 -> float16 through float32 (two roundings); numpy's direct cast differs by one
            # ulp on about 1 value in 20 000, so do as torch does to stay bit-exact with vLLM's own cast.
            values = values.astype(np.float32)
        return values.astype(tensors.numpy_dtype(target))

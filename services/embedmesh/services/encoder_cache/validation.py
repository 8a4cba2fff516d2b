"""What the public ``EncoderCacheService.Put`` accepts: every prompt-embeddings rule that does not need a model.

Each refusal is an InvalidArgument naming the field and the rule (reason in parentheses):
- floating dtype only: float16, bfloat16, float32, float64 (UNSUPPORTED_DTYPE)
- dense (sparse layouts are refused by the codec: SPARSE_TENSOR)
- 2-D ``(rows, hidden)`` or 3-D ``(1, rows, hidden)`` (BAD_RANK, BATCH_NOT_ONE)
- rows >= 1 and hidden >= 1 (EMPTY_EMBEDS)
- every value finite: no NaN, no Inf (NON_FINITE)
- size at most the configured cap (TOO_LARGE, checked by the codec before anything is allocated)
Hidden size and context length depend on the model: the preprocessor checks them again when an upload is used.
"""

from __future__ import annotations

import numpy as np

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["check_upload", "all_finite", "check_ttl"]


def all_finite(arr: np.ndarray, dtype: int) -> bool:
    """No NaN and no Inf (bf16 arrives as uint16 bits: exponent all ones means Inf or NaN)."""
    if dtype == tensor_pb2.DATA_TYPE_BF16:
        return bool(((arr & 0x7F80) != 0x7F80).all())
    return bool(np.isfinite(arr).all())


def check_upload(arr: np.ndarray, dtype: int, *, field: str, shape_field: str | None = None,
                 dtype_field: str | None = None) -> None:
    """Refuse what no model could use. ``shape_field``/``dtype_field`` name where the client sent the shape and
    dtype when it sent them apart from the bytes (raw uploads); otherwise everything is named ``field``."""
    shape_field = shape_field or field
    dtype_field = dtype_field or field
    name = tensors.DTYPE_NAMES.get(dtype, f"type {dtype}")
    if not tensors.is_float(dtype):
        raise InvalidArgument(
            f"{dtype_field}: dtype {name} is not accepted; upload float32, float16, bfloat16 or float64 embeddings",
            field=dtype_field, reason="UNSUPPORTED_DTYPE")
    shape = list(arr.shape)
    if arr.ndim == 3 and shape[0] != 1:
        raise InvalidArgument(
            f"{shape_field}: a 3-D tensor must be (1, num_tokens, hidden_size), got shape {shape}; upload one "
            "prompt per tensor", field=shape_field, reason="BATCH_NOT_ONE")
    if arr.ndim not in (2, 3):
        raise InvalidArgument(
            f"{shape_field}: expected a 2-D (num_tokens, hidden_size) or 3-D (1, num_tokens, hidden_size) tensor, "
            f"got {arr.ndim}-D shape {tensors.format_dims(shape)}", field=shape_field, reason="BAD_RANK")
    if shape[-2] < 1 or shape[-1] < 1:
        raise InvalidArgument(
            f"{shape_field}: shape {shape} holds no rows; at least one row of at least one value is required",
            field=shape_field, reason="EMPTY_EMBEDS")
    if not all_finite(arr, dtype):
        raise InvalidArgument(f"{field}: the prompt_embeds tensor contains NaN or Inf values; every value must be "
                              "finite", field=field, reason="NON_FINITE")


def check_ttl(ttl: int, max_ttl: int, field: str = "ttl_seconds") -> int:
    """``ttl`` if it is in ``[1, max_ttl]``, else an InvalidArgument naming ``field``."""
    if not 1 <= ttl <= max_ttl:
        raise InvalidArgument(
            f"{field}: must be between 1 and {max_ttl} seconds ({max_ttl / 86400:g} days), got {ttl}",
            field=field, reason="OUT_OF_RANGE")
    return ttl

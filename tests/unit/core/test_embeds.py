"""Validation rules of prompt embeddings against the model: one table of bad tensors, each naming the field and
the rule, and the casts that good tensors go through (checked against torch's own casts)."""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from embedmesh.core.embeds import ModelSpec, validate_embeds
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import check_cap, decode_tensor_bytes
from embedmesh.core.tensors import bf16_to_f32, f32_to_bf16
from embedmesh.tensor.v1 import tensor_pb2 as T  # noqa: N812 - T.DATA_TYPE_* reads well in tables

FP32 = ModelSpec(hidden_size=8, max_context_tokens=32, dtype=T.DATA_TYPE_FP32)
FP16 = ModelSpec(hidden_size=8, max_context_tokens=32, dtype=T.DATA_TYPE_FP16)
BF16 = ModelSpec(hidden_size=8, max_context_tokens=32, dtype=T.DATA_TYPE_BF16)
SPECS = {T.DATA_TYPE_FP32: FP32, T.DATA_TYPE_FP16: FP16, T.DATA_TYPE_BF16: BF16}
TORCH = {T.DATA_TYPE_FP32: torch.float32, T.DATA_TYPE_FP16: torch.float16, T.DATA_TYPE_BF16: torch.bfloat16,
         T.DATA_TYPE_FP64: torch.float64}


def good(rows: int = 3, dtype: str = "<f4") -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, 8)).astype(dtype)


def with_value(v: float, dtype: str = "<f4") -> np.ndarray:
    a = good(dtype=dtype)
    a[1, 2] = v
    return a


def bf16(a: np.ndarray) -> np.ndarray:
    return f32_to_bf16(a.astype(np.float32))


def as_numpy(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """A torch tensor as the codec would hand it over: (array, DataType), bf16 as bits."""
    dtype = {v: k for k, v in TORCH.items()}[t.dtype]
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), dtype
    return t.numpy(), dtype


def model_values(out: np.ndarray, spec: ModelSpec) -> np.ndarray:
    return bf16_to_f32(out) if spec.dtype == T.DATA_TYPE_BF16 else out


BAD = [
    ("1-D", good()[0], T.DATA_TYPE_FP32, FP32, "BAD_RANK"),
    ("4-D", good()[None, None], T.DATA_TYPE_FP32, FP32, "BAD_RANK"),
    ("0-D", np.float32(1.0).reshape(()), T.DATA_TYPE_FP32, FP32, "BAD_RANK"),
    ("batch of two", np.stack([good(), good()]), T.DATA_TYPE_FP32, FP32, "BATCH_NOT_ONE"),
    ("empty batch", np.zeros((0, 3, 8), np.float32), T.DATA_TYPE_FP32, FP32, "BATCH_NOT_ONE"),
    ("wrong hidden", np.zeros((3, 9), np.float32), T.DATA_TYPE_FP32, FP32, "HIDDEN_SIZE_MISMATCH"),
    ("transposed (hidden, N)", good().T, T.DATA_TYPE_FP32, FP32, "HIDDEN_SIZE_MISMATCH"),
    ("int32", np.zeros((3, 8), np.int32), T.DATA_TYPE_INT32, FP32, "UNSUPPORTED_DTYPE"),
    ("int64", np.zeros((3, 8), np.int64), T.DATA_TYPE_INT64, FP32, "UNSUPPORTED_DTYPE"),
    ("uint8", np.zeros((3, 8), np.uint8), T.DATA_TYPE_UINT8, FP32, "UNSUPPORTED_DTYPE"),
    ("bool", np.zeros((3, 8), bool), T.DATA_TYPE_BOOL, FP32, "UNSUPPORTED_DTYPE"),
    ("NaN", with_value(float("nan")), T.DATA_TYPE_FP32, FP32, "NON_FINITE"),
    ("+Inf", with_value(float("inf")), T.DATA_TYPE_FP32, FP32, "NON_FINITE"),
    ("-Inf", with_value(float("-inf")), T.DATA_TYPE_FP32, FP32, "NON_FINITE"),
    ("NaN in float16", with_value(float("nan"), "<f2"), T.DATA_TYPE_FP16, FP32, "NON_FINITE"),
    ("NaN in bf16", bf16(with_value(float("nan"))), T.DATA_TYPE_BF16, FP32, "NON_FINITE"),
    ("Inf in bf16 for a bf16 model", bf16(with_value(float("inf"))), T.DATA_TYPE_BF16, BF16, "NON_FINITE"),
    ("NaN in float64 for a bf16 model", with_value(float("nan"), "<f8"), T.DATA_TYPE_FP64, BF16, "NON_FINITE"),
    ("float64 overflowing float32", with_value(1e300, "<f8"), T.DATA_TYPE_FP64, FP32, "NON_FINITE"),
    ("float64 overflowing bfloat16", with_value(-1e39, "<f8"), T.DATA_TYPE_FP64, BF16, "NON_FINITE"),
    ("float32 overflowing float16", with_value(1e5), T.DATA_TYPE_FP32, FP16, "NON_FINITE"),
    ("bf16 overflowing float16", bf16(with_value(7e4)), T.DATA_TYPE_BF16, FP16, "NON_FINITE"),
    ("zero rows", np.zeros((0, 8), np.float32), T.DATA_TYPE_FP32, FP32, "EMPTY_EMBEDS"),
    ("zero rows in (1, 0, H)", np.zeros((1, 0, 8), np.float32), T.DATA_TYPE_FP32, FP32, "EMPTY_EMBEDS"),
    ("rows + max_tokens over context", good(30), T.DATA_TYPE_FP32, FP32, "CONTEXT_OVERFLOW"),
    ("rows alone over context", good(33), T.DATA_TYPE_FP32, FP32, "CONTEXT_OVERFLOW"),
]


@pytest.mark.parametrize("name,arr,dtype,spec,reason", BAD, ids=[b[0] for b in BAD])
def test_rule_violations_name_field_and_rule(name: str, arr: np.ndarray, dtype: int, spec: ModelSpec,
                                             reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_embeds(arr, dtype, spec, field="prompt_embeds[1]", max_tokens=4)
    assert info.value.field == "prompt_embeds[1]"
    assert info.value.reason == reason, info.value.message
    assert info.value.message.startswith("prompt_embeds[1]: ")


def test_messages_say_what_is_wrong() -> None:
    def message(arr: np.ndarray, dtype: int, spec: ModelSpec = FP32, max_tokens: int = 4) -> str:
        with pytest.raises(InvalidArgument) as info:
            validate_embeds(arr, dtype, spec, field="prompt_embeds", max_tokens=max_tokens)
        return info.value.message

    assert "30 rows + max_tokens 4 exceed the model's context of 32" in message(good(30), T.DATA_TYPE_FP32)
    assert "hidden size 9 does not match the model's hidden size 8" in message(
        np.zeros((3, 9), np.float32), T.DATA_TYPE_FP32)
    assert "dtype int64 is not accepted" in message(np.zeros((3, 8), np.int64), T.DATA_TYPE_INT64)
    assert "overflow the model dtype float32" in message(with_value(1e300, "<f8"), T.DATA_TYPE_FP64)
    assert "NaN or Inf" in message(with_value(float("nan")), T.DATA_TYPE_FP32)
    assert "[2, 3, 8]" in message(np.stack([good(), good()]), T.DATA_TYPE_FP32)


def test_rows_exactly_filling_the_context_pass() -> None:
    out = validate_embeds(good(28), T.DATA_TYPE_FP32, FP32, field="f", max_tokens=4)
    assert out.shape == (28, 8)


@pytest.mark.parametrize("target", list(SPECS), ids=["fp32 model", "fp16 model", "bf16 model"])
@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16, torch.float64, torch.float32], ids=str)
def test_float_inputs_are_cast_like_torch(src: torch.dtype, target: int) -> None:
    # A fixed seed: the same values every run (random ones hit a one-ulp double-rounding case now and then).
    t = (torch.randn(30, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 100).to(src)
    arr, dtype = as_numpy(t)
    spec = SPECS[target]
    out = validate_embeds(arr, dtype, spec, field="f", max_tokens=1)
    assert out.shape == (30, 8) and out.flags.c_contiguous
    expected, _ = as_numpy(t.to(TORCH[target]))
    assert out.dtype == expected.dtype
    assert np.array_equal(out, expected)  # bit-exact, bf16 rounding included


def test_three_d_is_squeezed_and_strided_input_made_contiguous() -> None:
    out = validate_embeds(good()[None], T.DATA_TYPE_FP32, FP32, field="f", max_tokens=1)
    assert out.shape == (3, 8)
    strided = np.asfortranarray(good(5))[::2]
    out = validate_embeds(strided, T.DATA_TYPE_FP32, FP32, field="f", max_tokens=1)
    assert out.flags.c_contiguous and np.array_equal(out, strided)


def test_array_not_matching_its_dtype_is_a_caller_bug() -> None:
    with pytest.raises(ValueError):
        validate_embeds(good(dtype="<f8"), T.DATA_TYPE_FP32, FP32, field="f", max_tokens=1)


# --- serialized or raw, then validated (the preprocessor's prompt_embeds line: decode, cap, rules) -----------------


def decode_prompt_embeds(*, encoded: bytes | None = None, array: np.ndarray | None = None, dtype: int = 0,
                         spec: ModelSpec, field: str, max_tokens: int, max_bytes: int) -> np.ndarray:
    """What services/preprocessor/prompt_embeds.py does with one entry, minus the cache: decode serialized bytes
    (or cap a raw array), then the shared rows rules."""
    if encoded is not None:
        arr, dtype = decode_tensor_bytes(encoded, max_bytes=max_bytes, field=field)
    elif array is not None:
        check_cap(field, array.nbytes, max_bytes)
        arr = array
    else:
        raise InvalidArgument(f"{field}: no tensor given", field=field, reason="REQUIRED")
    return validate_embeds(arr, dtype, spec, field=field, max_tokens=max_tokens)


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize("encode", [_saved, lambda t: st_save({"embeds": t})], ids=["torch.save", "safetensors"])
def test_decode_prompt_embeds_from_bytes(encode: Callable[[torch.Tensor], bytes]) -> None:
    t = torch.randn(1, 4, 8).to(torch.bfloat16)
    out = decode_prompt_embeds(encoded=encode(t), spec=FP32, field="prompt_embeds", max_tokens=1,
                               max_bytes=1 << 20)
    assert np.array_equal(out, t[0].float().numpy())


def test_decode_prompt_embeds_from_raw_array() -> None:
    arr = bf16(good())
    out = decode_prompt_embeds(array=arr, dtype=T.DATA_TYPE_BF16, spec=BF16, field="prompt_embeds", max_tokens=1,
                               max_bytes=1 << 20)
    assert np.array_equal(out, arr)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(array=good(), dtype=T.DATA_TYPE_FP32, max_bytes=64), "TOO_LARGE"),
    (dict(encoded=_saved(torch.zeros(3, 8)), max_bytes=64), "TOO_LARGE"),
    (dict(encoded=_saved(torch.zeros(3, 8, dtype=torch.int64)), max_bytes=1 << 20), "UNSUPPORTED_DTYPE"),
    (dict(encoded=_saved(torch.full((3, 8), float("nan"))), max_bytes=1 << 20), "NON_FINITE"),
    (dict(encoded=_saved(torch.zeros(3, 9)), max_bytes=1 << 20), "HIDDEN_SIZE_MISMATCH"),
    (dict(encoded=b"garbage", max_bytes=1 << 20), "NOT_A_TENSOR"),
    (dict(max_bytes=1 << 20), "REQUIRED"),
], ids=["raw over cap", "encoded over cap", "encoded int64", "encoded NaN", "encoded wrong hidden", "garbage",
        "nothing given"])
def test_decode_prompt_embeds_refusals(kwargs: dict, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_prompt_embeds(spec=FP32, field="prompt_embeds", max_tokens=1, **kwargs)
    assert info.value.reason == reason and info.value.field == "prompt_embeds"


def test_float64_to_bf16_rounds_through_float32_like_torch() -> None:
    # Just above a bf16 tie: a direct round would go up, but torch rounds to float32 first (landing exactly on the
    # tie) and then to even. The validator must give the same bits.
    arr = np.full((1, 8), 1.00390625 + 2**-40)
    out = validate_embeds(arr, T.DATA_TYPE_FP64, BF16, field="f", max_tokens=1)
    expected, _ = as_numpy(torch.from_numpy(arr).to(torch.bfloat16))
    assert np.array_equal(out, expected) and bf16_to_f32(out)[0, 0] == 1.0


# --- EmbedsResolver: key spaces, tenants, re-validation of uploads --------------------------------------------


async def test_resolver_caches_payloads_under_server_computed_validated_keys() -> None:
    from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
    from embedmesh.services.preprocessor.prompt_embeds import EmbedsResolver, RawEmbeds

    cache = TieredCache(CacheConfig(capacity_bytes=8 << 20))
    resolve = EmbedsResolver(cache, FP32, 1 << 20, 4)
    payload = _saved(torch.ones(3, 8))
    rows = await resolve(RawEmbeds(encoded=payload), "prompt_embeds")
    assert rows.shape == (3, 8)
    keys = cache.l1.keys()
    assert len(keys) == 1 and keys[0].startswith(f"v1:payload:{FP32.dtype}:8:") and len(keys[0]) > 64


async def test_resolver_uses_upload_ids_in_the_callers_tenant_only_and_revalidates() -> None:
    import grpc

    from embedmesh.core.auth import Principal, principal_scope
    from embedmesh.core.errors import EmbedmeshError
    from embedmesh.services.encoder_cache.keys import tenant_key
    from embedmesh.services.encoder_cache.tiered import CacheConfig, CachedTensor, TieredCache
    from embedmesh.services.preprocessor.prompt_embeds import EmbedsResolver, RawEmbeds

    cache = TieredCache(CacheConfig(capacity_bytes=8 << 20))
    resolve = EmbedsResolver(cache, FP32, 1 << 20, 4)
    await cache.put(tenant_key("a", "emb-good"), CachedTensor(good(), T.DATA_TYPE_FP32))
    await cache.put(tenant_key("a", "emb-wide"), CachedTensor(np.ones((2, 9), "<f4"), T.DATA_TYPE_FP32))
    with principal_scope(Principal("a")):
        assert (await resolve(RawEmbeds(cache_id="emb-good"), "prompt_embeds")).shape == (3, 8)
        with pytest.raises(InvalidArgument) as info:  # valid for the cache, not for this model
            await resolve(RawEmbeds(cache_id="emb-wide"), "messages[0].content[0]")
        assert info.value.reason == "HIDDEN_SIZE_MISMATCH" and info.value.field == "messages[0].content[0]"
    with principal_scope(Principal("b")):
        for name in ("emb-good", "u:a:emb-good", tenant_key("a", "emb-good")):
            with pytest.raises(EmbedmeshError) as err:
                await resolve(RawEmbeds(cache_id=name), "prompt_embeds")
            assert err.value.code == grpc.StatusCode.NOT_FOUND and err.value.field == "prompt_embeds"


def test_float64_to_float16_rounds_twice_like_torch() -> None:
    """torch goes float64 -> float32 -> float16; a direct cast differs by one ulp on ~1 value in 20 000."""
    from embedmesh.core.embeds import _cast

    x = torch.randn(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 100
    direct = x.numpy().astype(np.float16)
    assert (direct != x.to(torch.float16).numpy()).any()  # the case exists in this sample
    got = _cast(x.numpy(), T.DATA_TYPE_FP64, T.DATA_TYPE_FP16)
    assert np.array_equal(got, x.to(torch.float16).numpy())

"""Torch-free decoding of torch.save and safetensors payloads: values equal torch's own, and every bad payload is
an InvalidArgument with the field and a specific reason — never code execution, never a giant allocation."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import decode_safetensors, decode_tensor_bytes, decode_torch_save
from embedmesh.core.tensors import bf16_to_f32
from embedmesh.tensor.v1 import tensor_pb2

CAP = 64 << 20
MARKER = "/tmp/embedmesh-codec-pickle-ran"


def saved(obj: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def values(arr: np.ndarray, dtype: int) -> np.ndarray:
    return bf16_to_f32(arr) if dtype == tensor_pb2.DATA_TYPE_BF16 else arr.astype(np.float64)


def decode(data: bytes, cap: int = CAP) -> tuple[np.ndarray, int]:
    return decode_tensor_bytes(data, max_bytes=cap, field="prompt_embeds")


@pytest.mark.parametrize(
    "dtype,expected",
    [
        (torch.float32, tensor_pb2.DATA_TYPE_FP32),
        (torch.float16, tensor_pb2.DATA_TYPE_FP16),
        (torch.bfloat16, tensor_pb2.DATA_TYPE_BF16),
        (torch.float64, tensor_pb2.DATA_TYPE_FP64),
        (torch.int64, tensor_pb2.DATA_TYPE_INT64),
        (torch.bool, tensor_pb2.DATA_TYPE_BOOL),
    ],
)
def test_round_trip_equals_torch(dtype: torch.dtype, expected: int) -> None:
    t = (torch.randn(5, 7) * 3).to(dtype)
    arr, got = decode(saved(t))
    assert got == expected
    assert arr.shape == (5, 7)
    assert np.array_equal(values(arr, got), t.to(torch.float64).numpy())


@pytest.mark.parametrize(
    "make",
    [
        lambda base: base[:, 2:5],  # column slice: strided view
        lambda base: base.t(),  # transpose
        lambda base: base[3:],  # storage offset
        lambda base: base[::2, ::3],  # steps
        lambda base: base.unsqueeze(0),  # (1, N, H)
    ],
)
def test_views_decode_to_their_values(make: Any) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    view = make(base)
    arr, _ = decode(saved(view))
    assert np.array_equal(arr, view.contiguous().numpy())


def test_tensor_with_grad_fn_and_parameter_decode() -> None:
    emb = torch.nn.Embedding(20, 8)
    out = emb(torch.tensor([1, 2, 3]))  # requires_grad, has grad_fn: what clients really send
    arr, _ = decode(saved(out))
    assert np.array_equal(arr, out.detach().numpy())
    arr, _ = decode(saved(emb.weight))
    assert np.array_equal(arr, emb.weight.detach().numpy())


def test_safetensors_round_trip() -> None:
    from safetensors.torch import save

    t = torch.randn(4, 6).to(torch.bfloat16)
    arr, dtype = decode(save({"embeds": t}))
    assert dtype == tensor_pb2.DATA_TYPE_BF16
    assert np.array_equal(bf16_to_f32(arr), t.float().numpy())


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {MARKER}",))


def _zip_with(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buf.getvalue()


def _huge_header() -> bytes:
    """A real torch.save archive whose pickle claims a (10^6, 10^6) float tensor over a 4-element storage."""
    real = saved(torch.zeros(2, 2))
    src = zipfile.ZipFile(io.BytesIO(real))
    pkl = [n for n in src.namelist() if n.endswith("data.pkl")][0]
    fake = pickle.dumps(0)  # placeholder, replaced below
    data = src.read(pkl)
    # Rewrite the size and stride tuples: (2, 2) -> (1000000, 1000000), strides stay valid for the shape check.
    marker_size = b"K\x02K\x02\x86"
    assert marker_size in data
    data = data.replace(marker_size, b"J@B\x0f\x00J@B\x0f\x00\x86", 1)
    del fake
    return _zip_with({n: (data if n == pkl else src.read(n)) for n in src.namelist()})


def _truncated() -> bytes:
    real = saved(torch.zeros(16, 16))
    src = zipfile.ZipFile(io.BytesIO(real))
    return _zip_with({n: (src.read(n)[:10] if "/data/" in n else src.read(n)) for n in src.namelist()})


BAD: list[tuple[str, Any, str]] = [
    ("random bytes", lambda: os.urandom(256), "NOT_A_TENSOR"),
    ("empty", lambda: b"", "NOT_A_TENSOR"),
    ("zip that is not torch", lambda: _zip_with({"a.txt": b"hello"}), "NOT_A_TENSOR"),
    ("pickle running os.system", lambda: saved(_Evil()), "UNSAFE_PICKLE"),
    ("bare pickle", lambda: pickle.dumps(_Evil()), "LEGACY_FORMAT"),
    ("dict of tensors", lambda: saved({"a": torch.zeros(2, 2)}), "NOT_A_TENSOR"),
    ("list of tensors", lambda: saved([torch.zeros(2, 2)]), "NOT_A_TENSOR"),
    ("sparse COO", lambda: saved(torch.eye(4).to_sparse()), "SPARSE_TENSOR"),
    ("sparse CSR", lambda: saved(torch.eye(4).to_sparse_csr()), "SPARSE_TENSOR"),
    ("complex", lambda: saved(torch.zeros(2, 2, dtype=torch.complex64)), "UNSUPPORTED_DTYPE"),
    ("legacy format", lambda: saved(torch.zeros(2, 2), _use_new_zipfile_serialization=False), "LEGACY_FORMAT"),
    ("truncated storage", _truncated, "NOT_A_TENSOR"),
    ("cut in half", lambda: saved(torch.zeros(64, 64))[:2000], "NOT_A_TENSOR"),
    ("huge claimed shape", _huge_header, "TOO_LARGE"),
    ("over the cap", lambda: saved(torch.zeros(1024, 1024 * 17)), "TOO_LARGE"),
    ("safetensors bad header", lambda: struct.pack("<Q", 5) + b"{nope", "NOT_A_TENSOR"),
    ("safetensors two tensors", lambda: _safetensors({"a": torch.zeros(2), "b": torch.zeros(2)}), "NOT_A_TENSOR"),
    ("safetensors offsets out of range", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 400]}}, b"\0" * 16), "NOT_A_TENSOR"),
    ("safetensors unknown dtype", lambda: _safetensors_raw(
        {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "UNSUPPORTED_DTYPE"),
]


def _safetensors(d: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(d)


def _safetensors_raw(header: dict[str, Any], body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


@pytest.mark.parametrize("name,payload,reason", BAD, ids=[b[0] for b in BAD])
def test_bad_payloads_are_refused_with_a_reason(name: str, payload: Any, reason: str) -> None:
    if os.path.exists(MARKER):
        os.remove(MARKER)
    with pytest.raises(InvalidArgument) as info:
        decode(payload())
    assert info.value.field == "prompt_embeds"
    assert info.value.reason == reason, info.value.message
    assert info.value.message.startswith("prompt_embeds: ")
    assert not os.path.exists(MARKER), "pickle code ran"


def test_cap_message_names_the_cap() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode(saved(torch.zeros(1024, 1024)), cap=1 << 20)
    assert "1.0 MiB cap" in info.value.message and "4.0 MiB" in info.value.message


def test_explicit_decoders_refuse_the_other_format() -> None:
    with pytest.raises(InvalidArgument):
        decode_torch_save(_safetensors({"a": torch.zeros(2)}), max_bytes=CAP, field="f")
    with pytest.raises(InvalidArgument):
        decode_safetensors(saved(torch.zeros(2)), max_bytes=CAP, field="f")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 6), cols=st.integers(1, 6), transpose=st.booleans(), start=st.integers(0, 2),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_property_any_view_round_trips(rows: int, cols: int, transpose: bool, start: int, dtype: Any) -> None:
    base = torch.randn(rows + start, cols + start).to(dtype)
    view = base[start:, start:]
    if transpose:
        view = view.t()
    arr, got = decode(saved(view))
    assert arr.shape == tuple(view.shape)
    assert np.array_equal(values(arr, got), view.to(torch.float64).numpy())

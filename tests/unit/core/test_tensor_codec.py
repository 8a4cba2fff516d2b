"""Torch-free decoding of torch.save and safetensors payloads: values equal torch's own, and every bad payload is
an InvalidArgument with the field and a specific reason — never code execution, never a giant allocation.

Hostile archives are forged with a real pickler (``_ForgingPickler``) so each one differs from a genuine torch.save
file in exactly one claim: shape, strides, storage size, metadata, or the globals it names."""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import struct
import subprocess
import tempfile
import tracemalloc
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import decode_safetensors, decode_tensor_bytes, decode_torch_save, stored_tensor
from embedmesh.core.tensors import bf16_to_f32
from embedmesh.tensor.v1 import tensor_pb2 as T  # noqa: N812 - T.DATA_TYPE_* reads well in tables

CAP = 64 << 20
FIELD = "prompt_embeds"
MARKER = os.path.join(tempfile.gettempdir(), f"embedmesh-codec-pickle-ran-{os.getpid()}")

pytestmark = [
    # torch's own warnings while building the hostile payloads, not ours
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
]

TORCH_DTYPES = {
    torch.float32: T.DATA_TYPE_FP32,
    torch.float16: T.DATA_TYPE_FP16,
    torch.bfloat16: T.DATA_TYPE_BF16,
    torch.float64: T.DATA_TYPE_FP64,
    torch.int64: T.DATA_TYPE_INT64,
    torch.int32: T.DATA_TYPE_INT32,
    torch.int16: T.DATA_TYPE_INT16,
    torch.int8: T.DATA_TYPE_INT8,
    torch.uint8: T.DATA_TYPE_UINT8,
    torch.bool: T.DATA_TYPE_BOOL,
}
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def saved(obj: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def values(arr: np.ndarray, dtype: int) -> np.ndarray:
    """Decoded array -> float64 values (bf16 bits widened), to compare with torch's."""
    return bf16_to_f32(arr).astype(np.float64) if dtype == T.DATA_TYPE_BF16 else arr.astype(np.float64)


def torch_values(t: torch.Tensor) -> np.ndarray:
    return t.detach().resolve_neg().to(torch.float64).numpy()


def decode(data: bytes, cap: int = CAP) -> tuple[np.ndarray, int]:
    return decode_tensor_bytes(data, max_bytes=cap, field=FIELD)


# --- forging archives --------------------------------------------------------------------------------------------


class _Storage:
    """Pickled as a persistent id, the way torch.save writes a storage."""

    def __init__(self, cls: Any, key: str, numel: int) -> None:
        self.cls, self.key, self.numel = cls, key, numel


class _Call:
    """Pickled as ``fn(*args)`` — fn must be importable under its own name, as a real attacker's would be."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


class _ForgingPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def _zip_with(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buf.getvalue()


def forge(obj: Any, storages: dict[str, bytes] | None = None, byteorder: bytes = b"little") -> bytes:
    buf = io.BytesIO()
    _ForgingPickler(buf, protocol=2).dump(obj)
    entries = {"archive/data.pkl": buf.getvalue(), "archive/byteorder": byteorder, "archive/version": b"3\n"}
    entries.update({f"archive/data/{k}": v for k, v in (storages or {}).items()})
    return _zip_with(entries)


def forged_tensor(size: tuple[int, ...], stride: tuple[int, ...], *, offset: int = 0, numel: int | None = None,
                  data: bytes | None = None, metadata: Any = None, byteorder: bytes = b"little") -> bytes:
    """A float32 tensor record whose every claim is chosen by the test."""
    if numel is None:
        numel = offset + sum((d - 1) * s for d, s in zip(size, stride, strict=True)) + 1
    if data is None:
        data = np.arange(numel, dtype="<f4").tobytes()
    args: tuple[Any, ...] = (_Storage(torch.FloatStorage, "0", numel), offset, size, stride, False, OrderedDict())
    if metadata is not None:
        args += (metadata,)
    return forge(_Call(torch._utils._rebuild_tensor_v2, *args), {"0": data}, byteorder)


def _replace_entry(payload: bytes, pick: str, edit: Any) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(payload))
    return _zip_with({n: (edit(src.read(n)) if pick in n else src.read(n)) for n in src.namelist()})


def _safetensors_raw(header: Any, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


# --- good payloads -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=str)
def test_round_trip_equals_torch(dtype: torch.dtype) -> None:
    t = (torch.randn(5, 7) * 3).to(dtype)
    arr, got = decode(saved(t))
    assert got == TORCH_DTYPES[dtype]
    assert arr.shape == (5, 7) and arr.flags.c_contiguous
    assert np.array_equal(values(arr, got), torch_values(t))


VIEWS = {
    "column slice": lambda b: b[:, 2:5],
    "transpose": lambda b: b.t(),
    "row offset": lambda b: b[3:],
    "steps": lambda b: b[::2, ::3],
    "offset and step": lambda b: b[1::2, 3:9:2],
    "(1, N, H)": lambda b: b.unsqueeze(0),
    "expand (stride 0)": lambda b: b[:1].expand(4, 10),
    "3-D permute": lambda b: b.reshape(2, 3, 10).permute(2, 0, 1),
    "single element": lambda b: b[4:5, 6:7],
    "empty": lambda b: b[:0],
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("make", list(VIEWS.values()), ids=list(VIEWS))
def test_views_decode_to_their_values(make: Any, dtype: torch.dtype) -> None:
    base = torch.randn(6, 10).to(dtype)
    view = make(base)
    arr, got = decode(saved(view))
    assert arr.shape == tuple(view.shape) and arr.flags.c_contiguous
    assert np.array_equal(values(arr, got), torch_values(view))


def test_what_clients_really_send_decodes() -> None:
    emb = torch.nn.Embedding(20, 8)
    out = emb(torch.tensor([1, 2, 3]))  # requires_grad and a grad_fn, like model.get_input_embeddings()(ids)
    assert out.grad_fn is not None
    arr, _ = decode(saved(out))
    assert np.array_equal(arr, out.detach().numpy())


def test_parameter_and_tensor_with_python_attributes_decode() -> None:
    emb = torch.nn.Embedding(20, 8)
    arr, _ = decode(saved(emb.weight))  # _rebuild_parameter
    assert np.array_equal(arr, emb.weight.detach().numpy())
    t = torch.randn(3, 4)
    t.note = "from my pipeline"  # saved through _rebuild_from_type_v2(…, torch.Tensor, …, state)
    arr, _ = decode(saved(t))
    assert np.array_equal(arr, t.numpy())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_lazy_negation_bit_is_applied(dtype: torch.dtype) -> None:
    # torch stores the un-negated values plus metadata {"neg": True}; ignoring it would flip every sign.
    t = torch.randn(4, 6).to(dtype)._neg_view()
    assert t.is_neg()
    arr, got = decode(saved(t))
    assert np.array_equal(values(arr, got), torch_values(t))


def test_big_endian_archive_is_byteswapped() -> None:
    data = np.arange(6, dtype=">f4").tobytes()
    arr, _ = decode(forged_tensor((2, 3), (3, 1), data=data, byteorder=b"big"))
    assert np.array_equal(arr, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_result_owns_its_memory() -> None:
    payload = bytearray(saved(torch.ones(4, 4)))
    arr, _ = decode(bytes(payload))
    assert arr.flags.owndata and arr.flags.writeable


def rezipped(data: bytes) -> bytes:
    """The same entries, DEFLATE-compressed (torch.load reads such a file; torch.save never writes one)."""
    real = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n in real.namelist():
            z.writestr(n, real.read(n))
    return buf.getvalue()


def bomb(data: bytes, entry_suffix: str, inflated: int) -> bytes:
    """``data`` (a torch.save archive) with the entry ending in ``entry_suffix`` replaced by DEFLATE of its honest
    bytes followed by zeros up to ``inflated`` bytes, while both zip headers still claim the honest size and CRC:
    a ~``inflated/1000``-byte request that inflates to ``inflated`` bytes if a reader trusts the stream."""
    import zlib

    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    forged: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(out, "w") as z:
        for n in src.namelist():
            honest = src.read(n)
            if not n.endswith(entry_suffix):
                z.writestr(n, honest)
                continue
            info = zipfile.ZipInfo(n)
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, honest + b"\0" * (inflated - len(honest)))
            forged[n] = (len(honest), zlib.crc32(honest))
    raw = bytearray(out.getvalue())
    (name, (size, crc)), = forged.items()
    encoded = name.encode()
    local = raw.find(encoded) - 30  # the first occurrence of the name is its local header's
    assert raw[local:local + 4] == b"PK\x03\x04"
    struct.pack_into("<I", raw, local + 14, crc)
    struct.pack_into("<I", raw, local + 22, size)
    central = raw.find(b"PK\x01\x02")
    while raw[central + 46:central + 46 + len(encoded)] != encoded:
        central = raw.find(b"PK\x01\x02", central + 4)
        assert central > 0
    struct.pack_into("<I", raw, central + 16, crc)
    struct.pack_into("<I", raw, central + 24, size)
    return bytes(raw)


def test_compressed_storage_is_refused_before_inflating() -> None:
    # torch.save never compresses an entry, and a compressed one's sizes are claims: refused, not inflated.
    data = rezipped(saved(torch.randn(3, 5)))
    assert torch.load(io.BytesIO(data), weights_only=True).shape == (3, 5)  # a readable archive, all the same
    with pytest.raises(InvalidArgument) as info:
        decode(data)
    assert info.value.field == FIELD and info.value.reason == "COMPRESSED_ENTRY"
    assert "torch.save" in info.value.message


@pytest.mark.parametrize("entry", ["/data/0", "data.pkl", "/byteorder"])
def test_a_compression_bomb_with_honest_looking_headers_allocates_nothing_of_its_size(entry: str) -> None:
    """The attack: a real [9, 576] float32 torch.save whose entry is DEFLATE of 256 MiB, headers claiming the honest
    size and CRC. Refused with at most a few MiB allocated (zipfile's read() inflated the whole stream first)."""
    payload = bomb(saved(torch.randn(9, 576)), entry, 256 << 20)
    assert len(payload) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument) as info:
            decode(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.field == FIELD and info.value.reason == "COMPRESSED_ENTRY", info.value.message
    assert peak < 8 << 20, f"allocated {peak} bytes for a {len(payload)}-byte request"
    with pytest.raises(InvalidArgument) as stored:
        stored_tensor(payload, max_bytes=CAP, field=FIELD)  # the gateway's in-place path refuses it the same way
    assert stored.value.reason == "COMPRESSED_ENTRY"


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_safetensors_round_trip(dtype: torch.dtype) -> None:
    t = torch.randn(4, 6).to(dtype)
    arr, got = decode(st_save({"embeds": t}, metadata={"source": "test"}))
    assert got == TORCH_DTYPES[dtype]
    assert np.array_equal(values(arr, got), torch_values(t))


# --- bad payloads ------------------------------------------------------------------------------------------------


class _System:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {MARKER}",))


class _Eval:
    def __reduce__(self) -> Any:
        return (builtins.eval, (f"open({MARKER!r}, 'w').close()",))


class _Popen:
    def __reduce__(self) -> Any:
        return (subprocess.Popen, (["touch", MARKER],))


def _evil_storage_type() -> bytes:
    # os.system smuggled in where the storage class belongs, inside an otherwise genuine tensor record.
    return forge(_Call(torch._utils._rebuild_tensor_v2, _Storage(_System(), "0", 4), 0, (2, 2), (2, 1), False,
                       OrderedDict()), {"0": b"\0" * 16})


BAD: list[tuple[str, Any, str]] = [
    ("random bytes", lambda: os.urandom(256), "NOT_A_TENSOR"),
    ("empty", lambda: b"", "NOT_A_TENSOR"),
    ("text", lambda: b"[[0.1, 0.2], [0.3, 0.4]]", "NOT_A_TENSOR"),
    ("zip that is not torch", lambda: _zip_with({"a.txt": b"hello"}), "NOT_A_TENSOR"),
    ("zip magic then garbage", lambda: b"PK\x03\x04" + os.urandom(200), "NOT_A_TENSOR"),
    ("pickle running os.system", lambda: saved(_System()), "UNSAFE_PICKLE"),
    ("pickle running builtins.eval", lambda: saved(_Eval()), "UNSAFE_PICKLE"),
    ("pickle running subprocess.Popen", lambda: saved(_Popen()), "UNSAFE_PICKLE"),
    ("os.system as the storage class", _evil_storage_type, "UNSAFE_PICKLE"),
    ("bare pickle", lambda: pickle.dumps(_System()), "LEGACY_FORMAT"),
    ("dict of tensors", lambda: saved({"a": torch.zeros(2, 2)}), "NOT_A_TENSOR"),
    ("list of tensors", lambda: saved([torch.zeros(2, 2)]), "NOT_A_TENSOR"),
    ("tuple of tensors", lambda: saved((torch.zeros(2, 2), torch.zeros(2, 2))), "NOT_A_TENSOR"),
    ("a number", lambda: saved(3.5), "NOT_A_TENSOR"),
    ("a module's state_dict", lambda: saved(torch.nn.Linear(2, 2).state_dict()), "NOT_A_TENSOR"),
    ("sparse COO", lambda: saved(torch.eye(4).to_sparse()), "SPARSE_TENSOR"),
    ("sparse CSR", lambda: saved(torch.eye(4).to_sparse_csr()), "SPARSE_TENSOR"),
    ("complex", lambda: saved(torch.zeros(2, 2, dtype=torch.complex64)), "UNSUPPORTED_DTYPE"),
    ("quantized", lambda: saved(torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)), "UNSUPPORTED_DTYPE"),
    ("float8", lambda: saved(torch.zeros(2, 2, dtype=torch.float8_e4m3fn)), "UNSUPPORTED_DTYPE"),
    ("uint16", lambda: saved(torch.zeros(2, 2, dtype=torch.uint16)), "UNSUPPORTED_DTYPE"),
    ("meta tensor", lambda: saved(torch.empty(2, 2, device="meta")), "NOT_A_TENSOR"),
    ("legacy format", lambda: saved(torch.zeros(2, 2), _use_new_zipfile_serialization=False), "LEGACY_FORMAT"),
    ("storage entry truncated", lambda: _replace_entry(saved(torch.zeros(16, 16)), "/data/", lambda b: b[:10]),
     "NOT_A_TENSOR"),
    ("storage entry missing", lambda: forge(_Call(torch._utils._rebuild_tensor_v2,
                                                  _Storage(torch.FloatStorage, "0", 4), 0, (2, 2), (2, 1))),
     "NOT_A_TENSOR"),
    ("file cut in half", lambda: saved(torch.zeros(64, 64))[:2000], "NOT_A_TENSOR"),
    ("file cut at the end", lambda: saved(torch.zeros(64, 64))[:-30], "NOT_A_TENSOR"),
    ("shape larger than the storage", lambda: forged_tensor((4, 4), (4, 1), numel=4), "NOT_A_TENSOR"),
    ("offset past the storage", lambda: forged_tensor((2, 2), (2, 1), offset=3, numel=4), "NOT_A_TENSOR"),
    ("storage bigger than its entry", lambda: forged_tensor((2, 2), (2, 1), numel=100, data=b"\0" * 16),
     "NOT_A_TENSOR"),
    ("negative stride", lambda: forged_tensor((2, 2), (-1, 1), numel=4), "NOT_A_TENSOR"),
    ("shape and stride ranks differ", lambda: forged_tensor((2, 2), (1,), numel=4), "NOT_A_TENSOR"),
    ("float shape", lambda: forged_tensor((2.0, 2), (2, 1), numel=4), "NOT_A_TENSOR"),
    ("unknown metadata", lambda: forged_tensor((2, 2), (2, 1), metadata={"python_eval": "1"}), "NOT_A_TENSOR"),
    ("unknown byteorder", lambda: forged_tensor((2, 2), (2, 1), byteorder=b"middle"), "NOT_A_TENSOR"),
    ("huge claimed shape, tiny file", lambda: forged_tensor((10**6, 10**6), (10**6, 1), numel=4, data=b"\0" * 16),
     "TOO_LARGE"),
    ("huge claimed storage, small shape", lambda: forged_tensor((2, 2), (2, 1), numel=10**12, data=b"\0" * 16),
     "TOO_LARGE"),
    ("over the cap", lambda: saved(torch.zeros(1024, 1024 * 17)), "TOO_LARGE"),
    ("safetensors bad header", lambda: struct.pack("<Q", 5) + b"{nope", "NOT_A_TENSOR"),
    ("safetensors header past the end", lambda: struct.pack("<Q", 10**6) + b"{}", "NOT_A_TENSOR"),
    ("safetensors header is a list", lambda: _safetensors_raw([1, 2], b""), "NOT_A_TENSOR"),
    ("safetensors nested too deep", lambda: struct.pack("<Q", 200_002) + b"{" + b"[" * 200_000 + b"}",
     "NOT_A_TENSOR"),
    ("safetensors two tensors", lambda: st_save({"a": torch.zeros(2), "b": torch.zeros(2)}), "NOT_A_TENSOR"),
    ("safetensors no tensor", lambda: _safetensors_raw({"__metadata__": {}}, b""), "NOT_A_TENSOR"),
    ("safetensors offsets out of range", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}, b"\0" * 16), "NOT_A_TENSOR"),
    ("safetensors offsets disagree with shape", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 16), "NOT_A_TENSOR"),
    ("safetensors negative offset", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, b"\0" * 16), "NOT_A_TENSOR"),
    ("safetensors unknown dtype", lambda: _safetensors_raw(
        {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "UNSUPPORTED_DTYPE"),
    ("safetensors huge shape", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [10**9, 10**9], "data_offsets": [0, 8]}}, b"\0" * 8), "TOO_LARGE"),
    # The hostile-input classes of issue 15: each used to escape as a numpy ValueError/OverflowError (a 500).
    ("71 dimensions (torch.save)", lambda: saved(torch.zeros([1] * 71)), "BAD_RANK"),
    ("9 dimensions (forged)", lambda: forged_tensor((1,) * 9, (1,) * 9), "BAD_RANK"),
    ("shape product past 2**64", lambda: forged_tensor((2**32, 2**32, 2), (2**33, 2, 1), numel=4, data=b"\0" * 16),
     "INVALID_SHAPE"),
    ("dimensions within 2**31, product past 2**64", lambda: forged_tensor((2**31,) * 3, (2**62, 2**31, 1), numel=4,
                                                                          data=b"\0" * 16), "TOO_LARGE"),
    ("0 mixed with 2**64", lambda: forged_tensor((0, 2**64), (2**64, 1), numel=0, data=b""), "INVALID_SHAPE"),
    ("0 mixed with 2**64, 71 dims", lambda: forged_tensor((0,) + (2**64,) * 70, (1,) * 71, numel=0, data=b""),
     "BAD_RANK"),
    ("stride past int64 on a size-1 dim", lambda: forged_tensor((1, 4), (2**70, 1), numel=4), "BAD_STRIDES"),
    ("stride past int64 on an empty tensor", lambda: forged_tensor((0, 4), (2**64, 1), numel=0, data=b""),
     "BAD_STRIDES"),
    ("hand-edited huge stride", lambda: forged_tensor((2, 4), (2**40, 1), numel=8), "BAD_STRIDES"),
    ("stride reaching past a full storage", lambda: forged_tensor((4, 4), (5, 1), numel=16), "BAD_STRIDES"),
    ("offset past the storage of an empty tensor", lambda: forged_tensor((0, 4), (4, 1), offset=2**70, numel=0,
                                                                         data=b""), "NOT_A_TENSOR"),
    ("safetensors 71 dimensions", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [1] * 71, "data_offsets": [0, 4]}}, b"\0" * 4), "BAD_RANK"),
    ("safetensors 0 mixed with 2**64", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}, b""), "INVALID_SHAPE"),
    ("safetensors product past 2**64", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [2**31, 2**31, 2**31], "data_offsets": [0, 8]}}, b"\0" * 8), "TOO_LARGE"),
    ("safetensors negative dimension", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 0]}}, b""), "NOT_A_TENSOR"),
    ("safetensors dtype is a list", lambda: _safetensors_raw(
        {"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "UNSUPPORTED_DTYPE"),
    ("safetensors offsets past 2**64", lambda: _safetensors_raw(
        {"x": {"dtype": "F32", "shape": [1], "data_offsets": [2**64, 2**64 + 4]}}, b"\0" * 4), "NOT_A_TENSOR"),
]


@pytest.mark.parametrize("name,payload,reason", BAD, ids=[b[0] for b in BAD])
def test_bad_payloads_are_refused_with_a_reason(name: str, payload: Any, reason: str) -> None:
    if os.path.exists(MARKER):
        os.remove(MARKER)
    with pytest.raises(InvalidArgument) as info:
        decode(payload())
    assert info.value.field == FIELD
    assert info.value.reason == reason, info.value.message
    assert info.value.message.startswith(f"{FIELD}: ")
    assert not os.path.exists(MARKER), "pickle code ran"


def test_the_marker_pickle_does_run_under_plain_pickle() -> None:
    # Guards the table above: the hostile payload is live, so "marker not created" means the decoder refused it.
    if os.path.exists(MARKER):
        os.remove(MARKER)
    try:
        pickle.loads(pickle.dumps(_System()))
        assert os.path.exists(MARKER)
    finally:
        if os.path.exists(MARKER):
            os.remove(MARKER)


@pytest.mark.parametrize("payload", [
    lambda: forged_tensor((10**6, 10**6), (10**6, 1), numel=4, data=b"\0" * 16),
    lambda: forged_tensor((4, 4), (4, 1), numel=1 << 40, data=b"\0" * 64),
    lambda: saved(torch.zeros(1024, 1024 * 17)),
], ids=["huge shape", "huge storage", "real file over the cap"])
def test_cap_is_checked_before_allocating(payload: Any) -> None:
    data = payload()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument) as info:
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason == "TOO_LARGE"
    assert peak < 1 << 20, f"allocated {peak} bytes before refusing"


def test_cap_message_names_the_sizes_and_the_cap() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode(saved(torch.zeros(1024, 1024)), cap=1 << 20)
    msg = info.value.message
    assert "decoded size 4.0 MiB exceeds the 1.0 MiB cap (EMBEDMESH_MAX_EMBEDS_BYTES)" in msg
    with pytest.raises(InvalidArgument) as info:
        decode_tensor_bytes(saved(torch.zeros(1024, 1024)), max_bytes=1 << 20, field="chunk", cap_name="--max-x")
    assert "(--max-x)" in info.value.message and info.value.field == "chunk"


def test_a_tensor_exactly_at_the_cap_passes() -> None:
    t = torch.zeros(16, 16)
    arr, _ = decode(saved(t), cap=t.numel() * 4)
    assert arr.shape == (16, 16)


def test_explicit_decoders_refuse_the_other_format() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_torch_save(st_save({"a": torch.zeros(2)}), max_bytes=CAP, field="f")
    assert info.value.reason == "NOT_A_TENSOR"
    with pytest.raises(InvalidArgument) as info:
        decode_safetensors(saved(torch.zeros(2)), max_bytes=CAP, field="f")
    assert info.value.reason == "NOT_A_TENSOR"


def test_refusals_name_the_rule_and_print_no_huge_numbers() -> None:
    # str() of a 5000-digit int raises ValueError (Python's int_max_str_digits): the message must not call it.
    with pytest.raises(InvalidArgument) as info:
        decode(forged_tensor((0, 10**5000), (1, 1), numel=0, data=b""))
    assert "[0, 2**31]" in info.value.message and "[0, ~2**16609]" in info.value.message
    with pytest.raises(InvalidArgument) as info:
        decode(forged_tensor((2, 4), (2**40, 1), numel=8))
    assert "strides [1099511627776, 1]" in info.value.message and "past the storage's 8" in info.value.message


@pytest.mark.parametrize(("size", "stride", "numel"), [
    ((1, 4), (2**62, 1), 4),  # a size-1 dimension's stride addresses nothing
    ((4, 1), (1, 2**63 - 1), 4),
    ((0, 2**31), (2**31, 1), 0),  # empty, with the largest allowed dimension
    ((1,) * 8, (1,) * 8, 1),  # exactly MAX_RANK dimensions
], ids=["size-1 huge stride", "int64-max stride", "empty 2**31", "8 dims"])
def test_edge_layouts_decode(size: tuple[int, ...], stride: tuple[int, ...], numel: int) -> None:
    arr, dtype = decode(forged_tensor(size, stride, numel=numel, data=np.arange(numel, dtype="<f4").tobytes()))
    assert dtype == T.DATA_TYPE_FP32 and arr.shape == size and arr.flags.c_contiguous
    assert np.array_equal(arr.ravel(), np.arange(arr.size, dtype=np.float32))


# --- property: any strided view round-trips ----------------------------------------------------------------------


@st.composite
def strided_views(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOATS + [torch.int32, torch.bool]))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    base = (torch.randn(*shape) * 10).to(dtype)
    view = base.permute(*draw(st.permutations(range(len(shape)))))
    slices = []
    for d in view.shape:
        start = draw(st.integers(0, d - 1))
        slices.append(slice(start, draw(st.integers(start, d)), draw(st.integers(1, 3))))
    view = view[tuple(slices)]
    if draw(st.booleans()) and view.dtype.is_floating_point:
        view = view._neg_view()
    return view


@settings(max_examples=150, deadline=None)
@given(view=strided_views())
def test_property_any_view_round_trips(view: torch.Tensor) -> None:
    arr, got = decode(saved(view))
    assert got == TORCH_DTYPES[view.dtype]
    assert arr.shape == tuple(view.shape)
    assert np.array_equal(values(arr, got), torch_values(view))


def test_views_of_received_bytes_decode_like_bytes() -> None:
    """The preprocessor hands the codec a view of the request bytes (transport.wire): same values, same refusals."""
    t = torch.randn(7, 5)
    for payload in (saved(t), st_save({"e": t})):
        framed = b"xx" + payload + b"yy"  # a view inside a bigger buffer, as in a protobuf message
        arr, dtype = decode(memoryview(framed)[2:-2])
        expected, expected_dtype = decode(payload)
        assert dtype == expected_dtype and np.array_equal(arr, expected) and arr.flags.owndata
    for name, payload, reason in [*BAD, ("re-zipped", lambda: rezipped(saved(t)), "COMPRESSED_ENTRY")]:
        with pytest.raises(InvalidArgument) as info:
            decode(memoryview(payload()))
        assert info.value.reason == reason, name


# --- stored_tensor: the values read in place (the gateway's pieces path) ----------------------------------------


def _stored(data: bytes) -> Any:
    return stored_tensor(data, max_bytes=CAP, field=FIELD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("shape", [(7, 5), (1, 7, 5), (3, 1, 4), (9,)])
def test_stored_tensor_views_a_contiguous_tensor_as_decode_torch_save_reads_it(dtype: torch.dtype,
                                                                               shape: tuple[int, ...]) -> None:
    t = (torch.arange(int(np.prod(shape)), dtype=torch.float32) * 0.25 - 3).to(dtype).reshape(shape)
    data = saved(t)
    got = _stored(data)
    arr, want_dtype = decode_torch_save(data, max_bytes=CAP, field=FIELD)
    assert got is not None
    assert got.dtype == want_dtype == TORCH_DTYPES[dtype] and got.shape == shape
    assert bytes(got.data) == arr.tobytes()  # the same bytes a decode gives, in C order
    # a view of the payload, not a copy of it
    start = data.find(bytes(got.data[:16]))
    assert start > 0 and np.frombuffer(got.data, np.uint8).ctypes.data == np.frombuffer(data, np.uint8).ctypes.data \
        + start


@pytest.mark.parametrize("make", [
    lambda: torch.arange(35, dtype=torch.float32).reshape(5, 7).t(),   # transposed: strides not C order
    lambda: torch.arange(40, dtype=torch.float32).reshape(8, 5)[2:6],  # a slice: the storage holds more
    lambda: torch.arange(40, dtype=torch.float32)[1:],                  # an offset into the storage
    lambda: torch.arange(40, dtype=torch.float32).reshape(8, 5)[:, :3],  # rows with gaps
    lambda: torch.arange(12, dtype=torch.float32)._neg_view(),          # lazily negated values
    lambda: torch.zeros(0, 4),                                          # no values
])
def test_stored_tensor_declines_layouts_whose_values_are_not_the_stored_bytes(make: Any) -> None:
    data = saved(make())
    assert _stored(data) is None
    arr, _ = decode_torch_save(data, max_bytes=CAP, field=FIELD)  # which decode still reads
    assert arr.shape == tuple(make().shape)


def test_stored_tensor_declines_big_endian_and_refuses_compressed_archives() -> None:
    assert _stored(forged_tensor((2, 3), (3, 1), byteorder=b"little")) is not None
    assert _stored(forged_tensor((2, 3), (3, 1), byteorder=b"big")) is None
    zipped = rezipped(saved(torch.ones(4, 4)))
    for read in (_stored, lambda d: decode_torch_save(d, max_bytes=CAP, field=FIELD)):
        with pytest.raises(InvalidArgument) as info:
            read(zipped)
        assert info.value.reason == "COMPRESSED_ENTRY"


@pytest.mark.parametrize("payload, reason", [
    (b"PK\x03\x04 not really a zip", "NOT_A_TENSOR"),
    (pickle.dumps([1, 2]), "LEGACY_FORMAT"),
    (forge(_Call(os.system, "true")), "UNSAFE_PICKLE"),
    (forged_tensor((2, 3), (3, 1), numel=4), "NOT_A_TENSOR"),
])
def test_stored_tensor_refuses_what_decode_torch_save_refuses_with_the_same_error(payload: bytes,
                                                                                   reason: str) -> None:
    with pytest.raises(InvalidArgument) as mine:
        _stored(payload)
    with pytest.raises(InvalidArgument) as theirs:
        decode_torch_save(payload, max_bytes=CAP, field=FIELD)
    assert mine.value.reason == theirs.value.reason == reason
    assert mine.value.field == FIELD and str(mine.value) == str(theirs.value)
    assert not os.path.exists(MARKER)


def test_stored_tensor_checks_the_cap_before_reading() -> None:
    data = saved(torch.ones(64, 64))
    with pytest.raises(InvalidArgument) as e:
        stored_tensor(data, max_bytes=1024, field=FIELD)
    assert e.value.reason == "TOO_LARGE"

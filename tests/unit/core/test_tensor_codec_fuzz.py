"""Fuzzing the tensor decoders: whatever the bytes, ``decode_tensor_bytes`` / ``to_numpy`` (and the prompt-embeds
validation after them) return a well-formed array or raise ``InvalidArgument`` naming the field — never another
exception, which the servers would report as INTERNAL (a 500).

Inputs: tensor records forged with hostile shapes, strides, offsets and storage sizes; genuine ``torch.save`` files
with their pickle or their raw bytes mutated; safetensors files with hostile headers or mutated bytes; raw
``Tensor`` protos; random bytes. ``make fuzz`` runs the same properties with many more examples
(``EMBEDMESH_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from embedmesh.core import tensors
from embedmesh.core.embeds import ModelSpec, validate_embeds
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import decode_tensor_bytes
from embedmesh.tensor.v1 import tensor_pb2 as T  # noqa: N812
from tests.support.fuzz import fuzz_settings
from tests.unit.core.test_tensor_codec import _Call, _replace_entry, _Storage, forge, saved

CAP = 1 << 20
FIELD = "prompt_embeds"
SPEC = ModelSpec(hidden_size=4, max_context_tokens=64, dtype=T.DATA_TYPE_FP32)

STORAGES = ["FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "IntStorage",
            "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"]
TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
                torch.uint8, torch.bool]

# Numbers around every boundary an overflow could hide behind: the caps, int32/int64/uint64, numpy's intp.
EDGES = [2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1, 2**70,
         10**30, -1, -(2**63)]
hostile_int = st.one_of(st.integers(0, 6), st.integers(0, 6), st.sampled_from(EDGES), st.integers(-(2**80), 2**80))


def check_result(arr: np.ndarray, dtype: int) -> None:
    """What every caller relies on when the decoder does return."""
    assert isinstance(arr, np.ndarray)
    assert arr.dtype == tensors.numpy_dtype(dtype)
    assert arr.ndim <= tensors.MAX_RANK and all(0 <= d <= tensors.MAX_DIM for d in arr.shape)
    assert arr.nbytes <= CAP


def decode_or_refuse(data: bytes) -> None:
    """The property: a valid array (which the prompt-embeds rules then accept or refuse) or InvalidArgument."""
    try:
        arr, dtype = decode_tensor_bytes(data, max_bytes=CAP, field=FIELD)
    except InvalidArgument as e:
        assert e.field == FIELD and e.reason and e.message.startswith(f"{FIELD}: ")
        return
    check_result(arr, dtype)
    assert arr.flags.c_contiguous and arr.flags.owndata
    try:
        rows = validate_embeds(arr, dtype, SPEC, field=FIELD, max_tokens=1)
    except InvalidArgument as e:
        assert e.field == FIELD
        return
    assert rows.shape[1] == SPEC.hidden_size and np.isfinite(rows).all()


# --- forged records: every claim of the pickle chosen by hypothesis ---------------------------------------------


@st.composite
def forged_records(draw: st.DrawFn) -> bytes:
    name = draw(st.sampled_from(STORAGES))
    rank = draw(st.one_of(st.integers(0, 4), st.integers(0, 12), st.just(71)))
    size = tuple(draw(st.lists(hostile_int, min_size=rank, max_size=rank)))
    stride_rank = rank if draw(st.integers(0, 9)) else draw(st.integers(0, 5))  # mostly matching ranks
    stride = tuple(draw(st.lists(hostile_int, min_size=stride_rank, max_size=stride_rank)))
    offset = draw(hostile_int)
    itemsize = np.dtype(tensors.numpy_dtype(_DTYPE_OF[name])).itemsize
    if draw(st.booleans()) and all(0 <= d <= 6 for d in size + stride) and 0 <= offset <= 6:
        # Consistent with the claims, so the decode goes all the way through the strided copy.
        numel = offset + sum((d - 1) * s for d, s in zip(size, stride, strict=False) if d) + 1
    else:
        numel = draw(hostile_int)
    length = numel * itemsize if 0 <= numel * itemsize <= 4096 else draw(st.integers(0, 64))
    data = draw(st.binary(min_size=length, max_size=length)) if length <= 256 else bytes(length)
    storage = _Storage(getattr(torch, name), draw(st.sampled_from(["0", "1", "../0", ""])), numel)
    args: tuple[Any, ...] = (storage, offset, size, stride, draw(st.booleans()), OrderedDict())
    if draw(st.integers(0, 4)) == 0:
        args += (draw(st.sampled_from([{"neg": True}, {"conj": True}, {}, {"neg": 1}, {"x": 1}, [1]])),)
    record = _Call(torch._utils._rebuild_tensor_v2, *args)
    return forge(record, {"0": data}, draw(st.sampled_from([b"little", b"big", b"?"])))


_DTYPE_OF = {"FloatStorage": T.DATA_TYPE_FP32, "DoubleStorage": T.DATA_TYPE_FP64, "HalfStorage": T.DATA_TYPE_FP16,
             "BFloat16Storage": T.DATA_TYPE_BF16, "LongStorage": T.DATA_TYPE_INT64, "IntStorage": T.DATA_TYPE_INT32,
             "ShortStorage": T.DATA_TYPE_INT16, "CharStorage": T.DATA_TYPE_INT8, "ByteStorage": T.DATA_TYPE_UINT8,
             "BoolStorage": T.DATA_TYPE_BOOL}


@fuzz_settings(300)
@given(data=forged_records())
def test_forged_torch_records_decode_or_are_refused(data: bytes) -> None:
    decode_or_refuse(data)


# --- genuine torch.save files, mutated ---------------------------------------------------------------------------


@st.composite
def genuine_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    t = (torch.randn(tuple(shape)) * 4).to(dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[1::2]
    return t


def mutate(data: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, pos, blob in edits:
        if not out:
            out += blob
            continue
        at = pos % (len(out) + 1)
        if kind == "flip":
            out[at % len(out)] ^= (blob[0] if blob else 0xFF) or 1
        elif kind == "insert":
            out[at:at] = blob
        elif kind == "delete":
            del out[at:at + max(1, len(blob))]
        elif kind == "overwrite":
            out[at:at + len(blob)] = blob
        else:  # truncate
            del out[at:]
    return bytes(out)


edit_lists = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "overwrite", "truncate"]),
                                st.integers(0, 1 << 16), st.binary(min_size=1, max_size=9)), min_size=1, max_size=4)


@fuzz_settings(300)
@given(t=genuine_tensors(), edits=edit_lists, target=st.sampled_from(["pickle", "pickle", "file"]))
def test_mutated_torch_save_decodes_or_is_refused(t: torch.Tensor, edits: list[Any], target: str) -> None:
    payload = saved(t)
    if target == "pickle":  # re-zipped with valid CRCs, so the mutation reaches the restricted unpickler
        payload = _replace_entry(payload, "data.pkl", lambda b: mutate(b, edits))
    else:
        payload = mutate(payload, edits)
    decode_or_refuse(payload)


# --- safetensors -------------------------------------------------------------------------------------------------

junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4), st.lists(st.integers(),
                                                                                                    max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 3)) == 0:  # a genuine file with mutated bytes
        t = draw(genuine_tensors())
        if t.dtype == torch.bool and draw(st.booleans()):
            t = t.to(torch.uint8)
        return mutate(st_save({"x": t.contiguous()}), draw(edit_lists))
    rank = draw(st.one_of(st.integers(0, 4), st.integers(0, 12), st.just(71)))
    shape: Any = draw(st.lists(hostile_int, min_size=rank, max_size=rank))
    if draw(st.integers(0, 9)) == 0:
        shape = draw(junk)
    dtype = draw(st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "C64"]),
                           junk))
    offsets: Any = [draw(hostile_int), draw(hostile_int)]
    if draw(st.booleans()):
        count = 1
        for d in shape if isinstance(shape, list) else []:
            count *= d if isinstance(d, int) else 1
        offsets = [0, count * 4]
    if draw(st.integers(0, 9)) == 0:
        offsets = draw(junk)
    header: dict[str, Any] = {"x": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}
    if draw(st.booleans()):
        header["__metadata__"] = {"k": "v"}
    if draw(st.integers(0, 9)) == 0:
        header["y"] = draw(junk)
    body = draw(st.binary(max_size=128))
    raw = json.dumps(header).encode()
    length = len(raw) if draw(st.integers(0, 5)) else draw(hostile_int.filter(lambda v: 0 <= v < 2**64))
    return struct.pack("<Q", length) + raw + body


@fuzz_settings(300)
@given(data=safetensors_files())
def test_safetensors_decode_or_are_refused(data: bytes) -> None:
    decode_or_refuse(data)


# --- random bytes and raw protos ---------------------------------------------------------------------------------


@fuzz_settings(200)
@given(prefix=st.sampled_from([b"", b"PK\x03\x04", b"\x80\x02", struct.pack("<Q", 2) + b"{}"]),
       rest=st.binary(max_size=512))
def test_random_bytes_are_refused(prefix: bytes, rest: bytes) -> None:
    decode_or_refuse(prefix + rest)


int64 = st.one_of(st.integers(0, 6), st.sampled_from([e for e in EDGES if -(2**63) <= e < 2**63]),
                  st.integers(-(2**63), 2**63 - 1))


@fuzz_settings(300)
@given(dtype=st.one_of(st.integers(0, 12), st.integers(-(2**31), 2**31 - 1)),
       shape=st.one_of(st.lists(int64, max_size=10), st.lists(st.integers(0, 3), min_size=60, max_size=80)),
       exact=st.booleans(), junk_data=st.binary(max_size=64))
def test_tensor_protos_convert_or_are_refused(dtype: int, shape: list[int], exact: bool, junk_data: bytes) -> None:
    data = junk_data
    if exact and dtype in tensors.DTYPE_NAMES:  # the length the claims need, when it is small enough to send
        count = 1
        for d in shape:
            count *= d
        if 0 <= count * tensors.element_size(dtype) <= 4096:
            data = bytes(count * tensors.element_size(dtype))
    msg = T.Tensor(dtype=dtype, shape=shape, data=data)
    try:
        arr, got = tensors.to_numpy(msg, field="prompt_embeds[0]")
    except InvalidArgument as e:
        assert e.field is not None and e.field.startswith("prompt_embeds[0].")
        return
    assert got == dtype and arr.shape == tuple(shape) and arr.nbytes == len(data)
    check_result(arr, got)


def test_forged_record_strategy_reaches_the_strided_copy() -> None:
    # Guards the fuzz above: its consistent branch builds records that decode to values, not only refusals.
    data = forge(_Call(torch._utils._rebuild_tensor_v2, _Storage(torch.FloatStorage, "0", 7), 1, (2, 3), (3, 1),
                       False, OrderedDict()), {"0": np.arange(7, dtype="<f4").tobytes()})
    arr, _ = decode_tensor_bytes(data, max_bytes=CAP, field=FIELD)
    assert np.array_equal(arr, np.arange(1, 7, dtype=np.float32).reshape(2, 3))

"""The preprocessor's prompt-embeddings line (prompt_embeds.py): read -> decode -> validate -> cache -> fit.
(Key spaces and upload tenants are covered in tests/unit/core/test_embeds.py.)"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.transport.received import Received
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.services.preprocessor.prompt_embeds import EmbedsResolver, RawEmbeds, decode, read
from embedmesh.tensor.v1 import tensor_pb2

SPEC = ModelSpec(hidden_size=8, max_context_tokens=10, dtype=tensor_pb2.DATA_TYPE_FP32)


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_read_takes_a_wire_tensor_as_a_view_of_the_request_bytes() -> None:
    received = bytearray(np.arange(16, dtype="<f4").tobytes())
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[2, 8])  # data cut out of the received bytes
    request = Received(msg, {"prompt_embeds": memoryview(received)})
    raw = read(RawEmbeds(tensor=request.tensor("prompt_embeds", msg)), "prompt_embeds")
    assert raw.array is not None and raw.array.shape == (2, 8) and raw.dtype == tensor_pb2.DATA_TYPE_FP32
    assert np.shares_memory(raw.array, np.frombuffer(received, dtype=np.uint8))  # no copy
    with pytest.raises(InvalidArgument) as e:
        read(RawEmbeds(), "messages[0].content[1]")
    assert (str(e.value), e.value.reason) == ("messages[0].content[1]: neither tensor nor encoded is set",
                                              "REQUIRED")


async def test_decode_reads_torch_save_and_refuses_past_the_cap() -> None:
    arr, dtype = await decode(_saved(torch.ones(2, 8, dtype=torch.float16)), max_bytes=1 << 20, field="f")
    assert arr.shape == (2, 8) and dtype == tensor_pb2.DATA_TYPE_FP16
    with pytest.raises(InvalidArgument) as e:
        await decode(_saved(torch.ones(64, 8)), max_bytes=1024, field="f")
    assert e.value.reason == "TOO_LARGE"


async def test_a_cached_payload_is_still_fitted_to_each_requests_max_tokens() -> None:
    cache = TieredCache(CacheConfig(capacity_bytes=8 << 20))
    payload = _saved(torch.ones(6, 8))
    rows = await EmbedsResolver(cache, SPEC, 1 << 20, 4)(RawEmbeds(encoded=payload), "prompt_embeds")
    assert rows.shape == (6, 8) and len(cache.l1.keys()) == 1
    with pytest.raises(InvalidArgument) as e:  # the same payload, now a cache hit, with more tokens to generate
        await EmbedsResolver(cache, SPEC, 1 << 20, 5)(RawEmbeds(encoded=payload), "prompt_embeds")
    assert str(e.value) == "prompt_embeds: 6 rows + max_tokens 5 exceed the model's context of 10 positions"
    assert e.value.reason == "CONTEXT_OVERFLOW"


async def test_a_raw_array_is_capped_validated_and_cast() -> None:
    resolve = EmbedsResolver(TieredCache(CacheConfig(capacity_bytes=1 << 20)), SPEC, 256, 1)
    out = await resolve(RawEmbeds(array=np.ones((2, 8), "<f8"), dtype=tensor_pb2.DATA_TYPE_FP64), "prompt_embeds")
    assert out.dtype == np.float32 and out.shape == (2, 8)
    with pytest.raises(InvalidArgument) as e:
        await resolve(RawEmbeds(array=np.ones((8, 8), "<f8"), dtype=tensor_pb2.DATA_TYPE_FP64), "prompt_embeds")
    assert e.value.reason == "TOO_LARGE"

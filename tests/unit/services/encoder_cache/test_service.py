"""EncoderCacheService over a real gRPC server: chunked Put/Get of a 20 MiB tensor, Contains/Delete/Stats, and a
table of bad uploads, each INVALID_ARGUMENT naming the field, after which the service still serves."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import Server, ServerOptions, insecure_channel
from embedmesh.services.encoder_cache.service import SERVICE_NAME, EncoderCacheServicer
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.tensor.v1 import tensor_pb2 as tpb

CHUNK = 1 << 20


@pytest.fixture(scope="module")
async def stub() -> AsyncIterator[cache_pb2_grpc.EncoderCacheServiceStub]:
    cache = TieredCache(CacheConfig(capacity_bytes=64 << 20))
    server = Server("cache-test", ServerOptions(port=0))
    server.add(cache_pb2_grpc.add_EncoderCacheServiceServicer_to_server, EncoderCacheServicer(cache, 32 << 20),
               SERVICE_NAME)
    await server.start()
    channel = insecure_channel(server.address)
    yield cache_pb2_grpc.EncoderCacheServiceStub(channel)
    await channel.close()
    await server.drain()


def put_messages(header: cache_pb2.PutHeader | None, data: bytes) -> list[cache_pb2.PutRequest]:
    msgs = [cache_pb2.PutRequest(header=header)] if header is not None else []
    msgs += [cache_pb2.PutRequest(chunk=data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]
    return msgs


async def get_all(stub: Any, key: str) -> tuple[cache_pb2.TensorHeader, bytes]:
    header, data = None, bytearray()
    async for msg in stub.Get(cache_pb2.GetRequest(key=key)):
        if msg.WhichOneof("part") == "header":
            header = msg.header
        else:
            data += msg.chunk
    assert header is not None
    return header, bytes(data)


async def test_large_tensor_round_trips_in_chunks(stub: Any) -> None:
    arr = np.random.default_rng(1).standard_normal((9100, 576), dtype=np.float32)  # ~20 MiB
    header = cache_pb2.PutHeader(dtype=tpb.DATA_TYPE_FP32, shape=list(arr.shape))
    r = await stub.Put(iter(put_messages(header, arr.tobytes())))
    assert r.stored and r.key.startswith("emb-") and r.size_bytes == arr.nbytes
    got_header, data = await get_all(stub, r.key)
    assert list(got_header.shape) == list(arr.shape)
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(arr.shape), arr)
    present = await stub.Contains(cache_pb2.ContainsRequest(keys=[r.key, "emb-absent"]))
    assert list(present.present) == [True, False]
    stats = await stub.Stats(cache_pb2.StatsRequest())
    assert stats.tiers[0].tier == "l1" and stats.tiers[0].entries >= 1 and stats.tiers[0].hits >= 1
    assert (await stub.Delete(cache_pb2.DeleteRequest(key=r.key))).deleted
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_all(stub, r.key)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and from_rpc_error(info.value).field == "key"


async def test_torch_save_upload_is_decoded(stub: Any) -> None:
    import torch

    t = torch.randn(5, 576)
    buf = io.BytesIO()
    torch.save(t, buf)
    r = await stub.Put(iter(put_messages(cache_pb2.PutHeader(encoding=tpb.TENSOR_ENCODING_TORCH_SAVE),
                                         buf.getvalue())))
    _, data = await get_all(stub, r.key)
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(5, 576), t.numpy())


FP32 = tpb.DATA_TYPE_FP32
BAD = [
    ("no header", None, b"\0" * 16, "header"),
    ("chunk before header", "chunk-first", b"\0" * 16, "header"),
    ("bytes do not match shape", cache_pb2.PutHeader(dtype=FP32, shape=[4, 4]), b"\0" * 60, "chunk"),
    ("unknown dtype", cache_pb2.PutHeader(dtype=0, shape=[4]), b"\0" * 16, "header.dtype"),
    ("negative shape", cache_pb2.PutHeader(dtype=FP32, shape=[-1, 4]), b"", "header.shape"),
    ("over the cap", cache_pb2.PutHeader(dtype=FP32, shape=[9 << 20]), b"\0" * (33 << 20), "chunk"),
    ("bad torch payload", cache_pb2.PutHeader(encoding=tpb.TENSOR_ENCODING_TORCH_SAVE), b"nonsense", "chunk"),
]


@pytest.mark.parametrize("name,header,data,field", BAD, ids=[b[0] for b in BAD])
async def test_bad_uploads(stub: Any, name: str, header: Any, data: bytes, field: str) -> None:
    if header == "chunk-first":
        msgs = [cache_pb2.PutRequest(chunk=data), cache_pb2.PutRequest(header=cache_pb2.PutHeader(dtype=FP32))]
    else:
        msgs = put_messages(header, data)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Put(iter(msgs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(info.value).field == field
    ok = await stub.Put(iter(put_messages(cache_pb2.PutHeader(dtype=FP32, shape=[2]), b"\0" * 8)))
    assert ok.stored

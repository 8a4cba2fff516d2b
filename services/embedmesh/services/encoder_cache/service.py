"""Thin gRPC adapter for ``EncoderCacheService`` over a ``TieredCache``.

The preprocessor registers this servicer on its own server with its own cache instance, so a tensor uploaded
there is an L1 hit for the requests that refer to it; run standalone (``main.py``) it serves other clients.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument, NotFound
from embedmesh.core.tensor_codec import check_cap, decode_tensor_bytes
from embedmesh.services.encoder_cache.keys import content_key
from embedmesh.services.encoder_cache.redis_tier import CHUNK_BYTES
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache

__all__ = ["EncoderCacheServicer", "SERVICE_NAME", "lookup_upload"]

SERVICE_NAME = "embedmesh.cache.v1.EncoderCacheService"


async def lookup_upload(cache: TieredCache, key: str, field: str) -> CachedTensor:
    """An uploaded tensor by id, or NotFound naming the field (unknown or expired)."""
    value = await cache.get(key)
    if value is None:
        raise NotFound(f"{field}: no uploaded tensor with id {key!r} (unknown or expired); upload it again",
                       field=field, reason="EMBEDS_ID_NOT_FOUND")
    return value


class EncoderCacheServicer(cache_pb2_grpc.EncoderCacheServiceServicer):
    def __init__(self, cache: TieredCache, max_tensor_bytes: int) -> None:
        self.cache = cache
        self.max_tensor_bytes = max_tensor_bytes

    async def Put(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[cache_pb2.PutRequest], context: grpc.aio.ServicerContext
    ) -> cache_pb2.PutResponse:
        header: cache_pb2.PutHeader | None = None
        buf = bytearray()
        async for msg in request_iterator:
            part = msg.WhichOneof("part")
            if part == "header":
                if header is not None:
                    raise InvalidArgument("header: sent twice; send one header, then chunks", field="header",
                                          reason="DUPLICATE_HEADER")
                header = msg.header
            elif part == "chunk":
                if header is None:
                    raise InvalidArgument("header: the first message must be the header", field="header",
                                          reason="HEADER_FIRST")
                buf += msg.chunk
                check_cap("chunk", len(buf), self.max_tensor_bytes, "upload size")
        if header is None:
            raise InvalidArgument("header: missing; send one header, then chunks", field="header", reason="REQUIRED")
        if header.encoding != 0:
            arr, dtype = decode_tensor_bytes(bytes(buf), max_bytes=self.max_tensor_bytes, field="chunk")
        else:
            if header.dtype not in tensors.DTYPE_NAMES:
                raise InvalidArgument("header.dtype: set a DataType (or an encoding)", field="header.dtype",
                                      reason="UNSUPPORTED_DTYPE")
            if any(d < 0 for d in header.shape):
                raise InvalidArgument("header.shape: dimensions must be >= 0", field="header.shape",
                                      reason="INVALID_SHAPE")
            try:
                arr, dtype = tensors.to_numpy(
                    tensors.tensor_pb2.Tensor(dtype=header.dtype, shape=header.shape, data=bytes(buf)), field="chunk"
                )
            except InvalidArgument as e:
                raise InvalidArgument(e.message.replace("chunk.data", "chunk", 1), field="chunk",
                                      reason=e.reason) from None
        ttl = header.ttl_seconds if header.HasField("ttl_seconds") else None
        key = header.key or content_key(dtype, arr.shape, memoryview(np.ascontiguousarray(arr)).cast("B"))
        value = CachedTensor(np.ascontiguousarray(arr), dtype)
        stored = await self.cache.put(key, value, ttl)
        return cache_pb2.PutResponse(key=key, stored=stored, size_bytes=value.nbytes, dtype=dtype,
                                     shape=list(arr.shape), expires_at=self.cache.expires_at(ttl))

    async def Get(  # noqa: N802
        self, request: cache_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cache_pb2.GetResponse]:
        if not request.key:
            raise InvalidArgument("key is required", field="key", reason="REQUIRED")
        value = await lookup_upload(self.cache, request.key, "key")
        data = memoryview(np.ascontiguousarray(value.array)).cast("B")
        yield cache_pb2.GetResponse(header=cache_pb2.TensorHeader(dtype=value.dtype, shape=list(value.array.shape),
                                                                  size_bytes=len(data)))
        for i in range(0, len(data), CHUNK_BYTES):
            yield cache_pb2.GetResponse(chunk=bytes(data[i:i + CHUNK_BYTES]))

    async def Contains(  # noqa: N802
        self, request: cache_pb2.ContainsRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.ContainsResponse:
        return cache_pb2.ContainsResponse(present=[await self.cache.contains(k) for k in request.keys])

    async def Delete(  # noqa: N802
        self, request: cache_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.DeleteResponse:
        if not request.key:
            raise InvalidArgument("key is required", field="key", reason="REQUIRED")
        return cache_pb2.DeleteResponse(deleted=await self.cache.delete(request.key))

    async def Stats(  # noqa: N802
        self, request: cache_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.StatsResponse:
        l1 = self.cache.l1
        tiers = [cache_pb2.TierStats(
            tier="l1", entries=len(l1), current_bytes=l1.current_bytes, capacity_bytes=l1.capacity_bytes,
            utilization=l1.utilization, hits=l1.counters.hits, misses=l1.counters.misses,
            evictions=l1.counters.evictions, hit_rate=l1.counters.hit_rate, available=True,
        )]
        if self.cache.l2 is not None:
            c = self.cache.l2.counters
            tiers.append(cache_pb2.TierStats(
                tier="l2", capacity_bytes=await self.cache.l2.maxmemory(), hits=c.hits, misses=c.misses,
                hit_rate=c.hit_rate, corrupted=c.corrupted, unavailable=c.unavailable,
                available=self.cache.l2.available,
            ))
        return cache_pb2.StatsResponse(tiers=tiers)

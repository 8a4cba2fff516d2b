"""Thin gRPC adapter for ``EncoderCacheService`` over a ``TieredCache``.

The preprocessor registers this servicer on its own (public) port with its own cache instance, so a tensor
uploaded there is an L1 hit for the requests that refer to it; run standalone (``main.py``) it serves other
clients.

Trust (see ``keys``): everything a caller stores lands in its tenant's namespace (``u:<tenant>:<name>``), under a
random id the server hands out or a plain name the caller chose; ids are resolved only in the caller's tenant, so
another tenant's id is NOT_FOUND exactly as an unknown one. No RPC reaches the server's own validated entries
(``v1:…``). What Put stores is validated first with every prompt-embeddings rule that needs no model
(``validation.check_upload``), and ``ttl_seconds`` must be in ``[1, max_ttl_seconds]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core import tensors
from embedmesh.core.auth import current_principal
from embedmesh.core.errors import InvalidArgument, NotFound
from embedmesh.core.tensor_codec import check_cap, decode_tensor_bytes
from embedmesh.services.encoder_cache.keys import NAME_RULE, is_plain_name, new_upload_id, tenant_key
from embedmesh.services.encoder_cache.redis_tier import CHUNK_BYTES
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache
from embedmesh.services.encoder_cache.validation import check_ttl, check_upload

__all__ = ["EncoderCacheServicer", "SERVICE_NAME", "lookup_upload", "upload_key", "MAX_CONTAINS_KEYS"]

SERVICE_NAME = "embedmesh.cache.v1.EncoderCacheService"
MAX_CONTAINS_KEYS = 1024
"""Most keys one Contains may ask about."""


def upload_key(name: str) -> str | None:
    """Where the calling tenant's upload ``name`` lives; None when ``name`` cannot be an upload name (such a name is
    treated exactly as an unknown one)."""
    if not is_plain_name(name):
        return None
    return tenant_key(current_principal().tenant, name)


async def lookup_upload(cache: TieredCache, name: str, field: str) -> CachedTensor:
    """The caller's uploaded tensor by id, or NotFound naming the field (unknown, expired or another tenant's)."""
    key = upload_key(name)
    value = await cache.get(key) if key is not None else None
    if value is None:
        raise NotFound(f"{field}: no uploaded tensor with id {name[:160]!r} (unknown or expired); upload it again",
                       field=field, reason="EMBEDS_ID_NOT_FOUND")
    return value


class EncoderCacheServicer(cache_pb2_grpc.EncoderCacheServiceServicer):
    idle_bound_streams = {"Put": "chunk"}
    """Uploads with an end, by RPC name, with the field their messages fill: ``Server.add`` hands them to
    ``inbound.checked_stream``, so a Put that sends nothing for ``inbound.UPLOAD_IDLE_SECONDS`` is refused naming
    ``chunk`` instead of holding its tenant's slot until the client's own deadline."""

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
                self._check_header(header)
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
            check_upload(arr, dtype, field="chunk")
        else:
            try:
                arr, dtype = tensors.to_numpy(
                    tensors.tensor_pb2.Tensor(dtype=header.dtype, shape=header.shape, data=bytes(buf)), field="header"
                )
            except InvalidArgument as e:
                if e.field != "header.data":
                    raise
                raise InvalidArgument(e.message.replace("header.data", "chunk", 1), field="chunk",
                                      reason=e.reason) from None
            check_upload(arr, dtype, field="chunk", shape_field="header.shape", dtype_field="header.dtype")
        ttl = self.cache.ttl(header.ttl_seconds if header.HasField("ttl_seconds") else None)
        name = header.key or new_upload_id()
        key = upload_key(name)
        assert key is not None  # checked in _check_header; new ids are plain names
        value = CachedTensor(np.ascontiguousarray(arr), dtype)
        stored = await self.cache.put(key, value, ttl)
        return cache_pb2.PutResponse(key=name, stored=stored, size_bytes=value.nbytes, dtype=dtype,
                                     shape=list(arr.shape), expires_at=self.cache.expires_at(ttl))

    def _check_header(self, header: cache_pb2.PutHeader) -> None:
        """Refuse a client-chosen key outside the plain names, and a TTL out of bounds, before any bytes arrive."""
        if header.key and not is_plain_name(header.key):
            raise InvalidArgument(
                f"header.key: {header.key[:160]!r} is not a plain name; use {NAME_RULE} (no ':'), or leave it empty "
                "to get a random id. Keys of server-validated entries are never chosen by clients",
                field="header.key", reason="INVALID_KEY")
        if header.HasField("ttl_seconds"):
            check_ttl(header.ttl_seconds, self.cache.config.max_ttl_seconds)
        if header.encoding == 0:  # raw bytes: dtype and shape are known now, refuse before buffering anything
            if header.dtype not in tensors.DTYPE_NAMES:
                raise InvalidArgument("header.dtype: set a DataType (or an encoding)", field="header.dtype",
                                      reason="UNSUPPORTED_DTYPE")
            if not tensors.is_float(header.dtype):
                raise InvalidArgument(
                    f"header.dtype: dtype {tensors.DTYPE_NAMES[header.dtype]} is not accepted; upload float32, "
                    "float16, bfloat16 or float64 embeddings", field="header.dtype", reason="UNSUPPORTED_DTYPE")
            if any(d < 0 for d in header.shape):
                raise InvalidArgument("header.shape: dimensions must be >= 0", field="header.shape",
                                      reason="INVALID_SHAPE")
            if len(header.shape) not in (2, 3):
                raise InvalidArgument(
                    f"header.shape: expected a 2-D (num_tokens, hidden_size) or 3-D (1, num_tokens, hidden_size) "
                    f"tensor, got {len(header.shape)}-D shape {tensors.format_dims(list(header.shape))}",
                    field="header.shape", reason="BAD_RANK")
            count = tensors.check_shape(list(header.shape), "header.shape")
            check_cap("header.shape", count * tensors.element_size(header.dtype), self.max_tensor_bytes)

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
        if len(request.keys) > MAX_CONTAINS_KEYS:
            raise InvalidArgument(f"keys: at most {MAX_CONTAINS_KEYS} keys per call, got {len(request.keys)}",
                                  field="keys", reason="TOO_MANY_KEYS")
        present = []
        for name in request.keys:
            key = upload_key(name)
            present.append(key is not None and await self.cache.contains(key))
        return cache_pb2.ContainsResponse(present=present)

    async def Delete(  # noqa: N802
        self, request: cache_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.DeleteResponse:
        if not request.key:
            raise InvalidArgument("key is required", field="key", reason="REQUIRED")
        key = upload_key(request.key)
        return cache_pb2.DeleteResponse(deleted=key is not None and await self.cache.delete(key))

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
                available=self.cache.l2.available, rejected=c.rejected,
            ))
        return cache_pb2.StatsResponse(tiers=tiers)

"""L2 on Redis: chunked values with a checksummed header, TTL, fail-fast when Redis is away, self-reconnect.

Layout per key: ``<prefix><key>:h`` holds a header (magic, dtype, shape, byte count, chunk count, BLAKE3 of the
bytes) and ``<prefix><key>:c<i>`` the ~1 MiB chunks, all written in one MULTI with the same TTL, so no value is
ever one giant Redis string. A read whose chunks are missing, short or fail the checksum is a miss (counted as
``corrupted``) and the key is removed: a damaged value is never served.

Availability: any connection error marks Redis down, logs once per outage, and makes calls return "miss"/"not
stored" at once (no waiting on timeouts) until the next probe (every ``retry_seconds``) succeeds.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import blake3
import numpy as np

from embedmesh.core.logs import get_logger
from embedmesh.core.tensors import DTYPE_NAMES, numpy_dtype
from embedmesh.services.encoder_cache.lru import TierCounters

__all__ = ["RedisTier", "RedisCounters"]

log = get_logger(__name__)

_MAGIC = b"EMC1"
CHUNK_BYTES = 1 << 20


@dataclass
class RedisCounters(TierCounters):
    corrupted: int = 0
    unavailable: int = 0


class RedisTier:
    def __init__(self, url: str, *, prefix: str = "embedmesh:cache:", timeout_seconds: float = 0.5,
                 retry_seconds: float = 1.0) -> None:
        import redis.asyncio as redis

        self.url = url
        self.prefix = prefix
        self.counters = RedisCounters()
        self.available = True
        self._retry_seconds = retry_seconds
        self._next_probe = 0.0
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                            socket_connect_timeout=timeout_seconds, retry_on_timeout=False)
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)

    async def close(self) -> None:
        await self._client.aclose()

    def _skip(self) -> bool:
        """True while Redis is known down and it is not yet time to probe again."""
        return not self.available and time.monotonic() < self._next_probe

    def _down(self, err: BaseException) -> None:
        self.counters.unavailable += 1
        self._next_probe = time.monotonic() + self._retry_seconds
        if self.available:
            self.available = False
            log.warning("redis unavailable; the encoder cache serves from L1 only until it returns",
                        extra={"url": self.url, "error": repr(err)})

    def _up(self) -> None:
        if not self.available:
            self.available = True
            log.info("redis reachable again; L2 back in use", extra={"url": self.url})

    async def put(self, key: str, arr: np.ndarray, dtype: int, ttl_seconds: int) -> bool:
        if self._skip():
            self.counters.unavailable += 1
            return False
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        chunks = [bytes(data[i:i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        header = _MAGIC + struct.pack(f"<II{arr.ndim}qQI", dtype, arr.ndim, *arr.shape, len(data), len(chunks))
        header += blake3.blake3(data).digest(16)
        base = self.prefix + key
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for i, c in enumerate(chunks):
                    pipe.set(f"{base}:c{i}", c, ex=ttl_seconds)
                pipe.set(f"{base}:h", header, ex=ttl_seconds)
                await pipe.execute()
        except self._errors as e:
            self._down(e)
            return False
        self._up()
        return True

    async def get(self, key: str) -> tuple[np.ndarray, int] | None:
        if self._skip():
            self.counters.unavailable += 1
            self.counters.misses += 1
            return None
        base = self.prefix + key
        try:
            header = await self._client.get(f"{base}:h")
            if header is None:
                self._up()
                self.counters.misses += 1
                return None
            parsed = _parse_header(header)
            if parsed is None:
                return await self._corrupt(key, "bad header")
            dtype, shape, nbytes, nchunks, digest = parsed
            parts = await self._client.mget([f"{base}:c{i}" for i in range(nchunks)])
        except self._errors as e:
            self._down(e)
            self.counters.misses += 1
            return None
        self._up()
        if any(p is None for p in parts):
            return await self._corrupt(key, "missing chunk")
        data = b"".join(parts)
        if len(data) != nbytes:
            return await self._corrupt(key, f"length {len(data)} != {nbytes}")
        if blake3.blake3(data).digest(16) != digest:
            return await self._corrupt(key, "checksum mismatch")
        arr = np.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape)
        self.counters.hits += 1
        return arr, dtype

    async def _corrupt(self, key: str, why: str) -> None:
        self.counters.corrupted += 1
        self.counters.misses += 1
        log.warning("corrupted L2 value dropped", extra={"key": key, "why": why})
        await self.delete(key)
        return None

    async def delete(self, key: str) -> bool:
        if self._skip():
            return False
        base = self.prefix + key
        try:
            header = await self._client.get(f"{base}:h")
            n = 0
            parsed = _parse_header(header) if header else None
            if parsed:
                n = parsed[3]
            removed = await self._client.delete(f"{base}:h", *[f"{base}:c{i}" for i in range(n)])
        except self._errors as e:
            self._down(e)
            return False
        self._up()
        return bool(removed)

    async def contains(self, key: str) -> bool:
        if self._skip():
            return False
        try:
            found = await self._client.exists(self.prefix + key + ":h")
        except self._errors as e:
            self._down(e)
            return False
        self._up()
        return bool(found)

    async def maxmemory(self) -> int:
        if self._skip():
            return 0
        try:
            cfg = await self._client.config_get("maxmemory")
        except self._errors as e:
            self._down(e)
            return 0
        except Exception:  # noqa: BLE001 - CONFIG may be disabled on managed Redis
            return 0
        return int(cfg.get("maxmemory", 0) or 0)


def _parse_header(h: bytes) -> tuple[int, tuple[int, ...], int, int, bytes] | None:
    try:
        if h[:4] != _MAGIC:
            return None
        dtype, ndim = struct.unpack_from("<II", h, 4)
        if dtype not in DTYPE_NAMES or ndim > 8:
            return None
        off = 12
        shape = struct.unpack_from(f"<{ndim}q", h, off)
        off += 8 * ndim
        nbytes, nchunks = struct.unpack_from("<QI", h, off)
        off += 12
        digest = h[off:off + 16]
        if len(digest) != 16 or nchunks > (nbytes // CHUNK_BYTES) + 1:
            return None
        return dtype, shape, nbytes, nchunks, digest
    except struct.error:
        return None

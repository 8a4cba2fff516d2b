"""L2 on Redis: chunked values under an integrity digest, TTL, fail-fast when Redis is away, self-reconnect.

Layout per key: ``<prefix><key>:h`` holds a header (magic, dtype, shape, byte count, chunk count, digest) and
``<prefix><key>:c<i>`` the ~1 MiB chunks, all written in one MULTI with the same TTL, so no value is ever one giant
Redis string.

Integrity: the digest is BLAKE3 over (key, dtype, shape, bytes), keyed with a 32-byte key derived from the mesh
token when one is configured (``EMBEDMESH_MESH_TOKEN`` / ``--mesh-token``), unkeyed otherwise. A read whose header or
chunks are missing, short, or whose digest does not match is a miss counted as ``corrupted``, and the key is
removed: a damaged or planted value is never served. Because the key is part of the digest, a valid entry copied to
another key fails too; with a mesh token, someone who can write to Redis but does not know the token cannot plant
entries at all. Without a token the digest only detects damage (anyone can compute it).

Availability: an error talking to Redis (connection refused or reset, timeout) marks it down, logs once per outage,
and makes calls return "miss"/"not stored" at once (no waiting on timeouts) until a probe succeeds; probes back off
from ``retry_seconds`` doubling up to ``max_retry_seconds``, one caller probing at a time. A command Redis refuses
while up (``OOM`` at ``maxmemory`` with ``noeviction``, a read-only replica) is counted as ``rejected`` and is a
"not stored"/miss; it does not mark Redis down. No method of this class raises for anything Redis does.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass

import blake3
import numpy as np
from prometheus_client import Counter

from embedmesh.core.logs import get_logger
from embedmesh.core.tensors import DTYPE_NAMES, MAX_RANK, element_size, numpy_dtype
from embedmesh.services.encoder_cache.lru import TierCounters

__all__ = ["RedisTier", "RedisCounters", "integrity_key", "CHUNK_BYTES"]

log = get_logger(__name__)

_MAGIC = b"EMC2"
_DIGEST_BYTES = 32
CHUNK_BYTES = 1 << 20
_KDF_CONTEXT = "embedmesh 2025 encoder-cache L2 entry integrity v1"

L2_REJECTED = Counter("embedmesh_encoder_cache_l2_rejected_total",
                      "L2 commands Redis refused while reachable (e.g. OOM at maxmemory)", ["op"])
L2_CORRUPTED = Counter("embedmesh_encoder_cache_l2_corrupted_total",
                       "L2 values dropped because their header, length or integrity digest was wrong")


@dataclass
class RedisCounters(TierCounters):
    corrupted: int = 0
    unavailable: int = 0
    rejected: int = 0


def integrity_key(mesh_token: str) -> bytes | None:
    """The 32-byte BLAKE3 key derived from the mesh token; None (unkeyed digests) without a token."""
    if not mesh_token:
        return None
    return blake3.blake3(mesh_token.encode(), derive_key_context=_KDF_CONTEXT).digest()


def _configured_token() -> str:
    from embedmesh.core import tls

    return tls.current().mesh_token


class RedisTier:
    def __init__(self, url: str, *, prefix: str = "embedmesh:cache:", timeout_seconds: float = 0.5,
                 retry_seconds: float = 0.5, max_retry_seconds: float = 5.0, mesh_token: str | None = None) -> None:
        import redis.asyncio as redis
        from redis import exceptions

        self.url = url
        self.prefix = prefix
        self.counters = RedisCounters()
        self.available = True
        self._retry_seconds = retry_seconds
        self._max_retry_seconds = max(max_retry_seconds, retry_seconds)
        self._backoff = retry_seconds
        self._next_probe = 0.0
        self._key = integrity_key(_configured_token() if mesh_token is None else mesh_token)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                            socket_connect_timeout=timeout_seconds, retry_on_timeout=False)
        # Refusals by a reachable server (OOM, READONLY, WRONGTYPE, EXECABORT): the command failed, Redis is up.
        self._refused: tuple[type[BaseException], ...] = (exceptions.ResponseError,)
        # Everything else from the client library or the socket means Redis cannot be used right now.
        self._errors: tuple[type[BaseException], ...] = (exceptions.RedisError, OSError, EOFError)

    @property
    def keyed(self) -> bool:
        """Whether digests are keyed with the mesh token (planting needs the token) or only detect damage."""
        return self._key is not None

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except self._errors:
            pass

    def _skip(self) -> bool:
        """True while Redis is known down and it is not yet time to probe again; the caller that gets False while
        Redis is down is the probe (the next one is pushed out, so only one caller probes at a time)."""
        if self.available:
            return False
        now = time.monotonic()
        if now < self._next_probe:
            return True
        self._next_probe = now + self._backoff
        return False

    def _down(self, err: BaseException) -> None:
        self.counters.unavailable += 1
        if self.available:
            self.available = False
            self._backoff = self._retry_seconds
            log.warning("redis unavailable; the encoder cache serves from L1 only until it returns",
                        extra={"url": self.url, "error": repr(err)})
        else:
            self._backoff = min(self._backoff * 2, self._max_retry_seconds)
        self._next_probe = time.monotonic() + self._backoff

    def _up(self) -> None:
        self._backoff = self._retry_seconds
        if not self.available:
            self.available = True
            log.info("redis reachable again; L2 back in use", extra={"url": self.url})

    def _rejected(self, op: str, err: BaseException) -> None:
        self.counters.rejected += 1
        L2_REJECTED.labels(op).inc()
        if self.counters.rejected == 1 or self.counters.rejected % 1000 == 0:
            log.warning("redis refused a command; L2 skipped for it", extra={"op": op, "error": str(err)[:200],
                                                                               "rejected": self.counters.rejected})

    def _fail(self, op: str, err: BaseException) -> None:
        if isinstance(err, self._refused):
            self._up()
            self._rejected(op, err)
        else:
            self._down(err)

    def _digest(self, key: str, dtype: int, shape: tuple[int, ...], data: bytes | memoryview) -> bytes:
        h = blake3.blake3(key=self._key) if self._key is not None else blake3.blake3()
        k = key.encode()
        h.update(struct.pack(f"<Q{len(k)}sII{len(shape)}q", len(k), k, dtype, len(shape), *shape))
        h.update(data)
        return h.digest(_DIGEST_BYTES)

    async def put(self, key: str, arr: np.ndarray, dtype: int, ttl_seconds: int) -> bool:
        if self._skip():
            self.counters.unavailable += 1
            return False
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        chunks = [bytes(data[i:i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        shape = tuple(int(d) for d in arr.shape)
        header = _MAGIC + struct.pack(f"<II{len(shape)}qQI", dtype, len(shape), *shape, len(data), len(chunks))
        header += self._digest(key, dtype, shape, data)
        base = self.prefix + key
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for i, c in enumerate(chunks):
                    pipe.set(f"{base}:c{i}", c, ex=ttl_seconds)
                pipe.set(f"{base}:h", header, ex=ttl_seconds)
                await pipe.execute()
        except self._errors as e:
            self._fail("put", e)
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
                self._up()
                return await self._corrupt(key, "bad header")
            dtype, shape, nbytes, nchunks, digest = parsed
            parts = await self._client.mget([f"{base}:c{i}" for i in range(nchunks)])
        except self._errors as e:
            self._fail("get", e)
            self.counters.misses += 1
            return None
        self._up()
        if any(p is None for p in parts):
            return await self._corrupt(key, "missing chunk")
        data = b"".join(parts)
        if len(data) != nbytes:
            return await self._corrupt(key, f"length {len(data)} != {nbytes}")
        if self._digest(key, dtype, shape, data) != digest:
            return await self._corrupt(key, "integrity digest mismatch")
        arr = np.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape)
        self.counters.hits += 1
        return arr, dtype

    async def _corrupt(self, key: str, why: str) -> None:
        self.counters.corrupted += 1
        self.counters.misses += 1
        L2_CORRUPTED.inc()
        log.warning("corrupted L2 value dropped", extra={"key": key, "why": why})
        await self.delete(key)
        return None

    async def delete(self, key: str) -> bool:
        if self._skip():
            return False
        base = self.prefix + key
        try:
            header = await self._client.get(f"{base}:h")
            parsed = _parse_header(header) if header else None
            # A damaged header may not say how many chunks there are: remove every chunk key of this entry.
            n = parsed[3] if parsed else 0
            names = [f"{base}:h", *[f"{base}:c{i}" for i in range(n)]]
            if header is not None and parsed is None:
                names += [k async for k in self._client.scan_iter(match=_glob_escape(base) + ":c*", count=1000)]
            removed = await self._client.delete(*names)
        except self._errors as e:
            self._fail("delete", e)
            return False
        self._up()
        return bool(removed)

    async def contains(self, key: str) -> bool:
        if self._skip():
            return False
        try:
            found = await self._client.exists(self.prefix + key + ":h")
        except self._errors as e:
            self._fail("contains", e)
            return False
        self._up()
        return bool(found)

    async def maxmemory(self) -> int:
        if self._skip():
            return 0
        try:
            cfg = await self._client.config_get("maxmemory")
        except self._refused:
            return 0  # CONFIG may be disabled on managed Redis
        except self._errors as e:
            self._down(e)
            return 0
        return int(cfg.get(b"maxmemory", cfg.get("maxmemory", 0)) or 0)


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _parse_header(h: bytes) -> tuple[int, tuple[int, ...], int, int, bytes] | None:
    """The header's fields when they are self-consistent (shape matches the byte count), else None."""
    try:
        if h[:4] != _MAGIC:
            return None
        dtype, ndim = struct.unpack_from("<II", h, 4)
        if dtype not in DTYPE_NAMES or ndim > MAX_RANK:
            return None
        off = 12
        shape = struct.unpack_from(f"<{ndim}q", h, off)
        off += 8 * ndim
        nbytes, nchunks = struct.unpack_from("<QI", h, off)
        off += 12
        digest = h[off:off + _DIGEST_BYTES]
        if len(digest) != _DIGEST_BYTES or len(h) != off + _DIGEST_BYTES:
            return None
        if any(d < 0 for d in shape) or math.prod(shape) * element_size(dtype) != nbytes:
            return None
        if nchunks != max(1, -(-nbytes // CHUNK_BYTES)):
            return None
        return dtype, tuple(shape), nbytes, nchunks, digest
    except struct.error:
        return None

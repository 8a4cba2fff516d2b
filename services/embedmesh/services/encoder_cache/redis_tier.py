"""L2 on Redis: chunked values under an integrity digest, TTL, fail-fast when Redis is away, self-reconnect.

Layout per key: ``<prefix><key>:h`` holds a header (magic, dtype, shape, byte count, chunk count, digest) and
``<prefix><key>:c<i>`` the ~1 MiB chunks, all written in one MULTI with the same TTL, so no value is ever one giant
Redis string.

Transfer: an L1 miss reads the header and the first chunk in one round trip (MGET; an entry of up to 1 MiB is then
complete), then the other chunks four per MGET (one giant reply costs Redis far more CPU). Each chunk body goes from
the socket straight into its slice of one preallocated array (``resp``: no per-chunk ``bytes``, no join) and is
digested as it arrives; the rows returned are a read-only view of that array. A write is one MULTI..EXEC pipeline
sent from the array itself. The header is checked before any chunk is kept, and ``get``'s ``want`` may decline the
entry by size there (``size_rule``). URLs the lean client does not serve (TLS, RESP3, other options) go through
redis-py with the same layout and checks.

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

import hmac
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from embedmesh.core import fastpath
from embedmesh.core.logs import get_logger
from embedmesh.core.tensors import DTYPE_NAMES, MAX_RANK, element_size, numpy_dtype
from embedmesh.services.encoder_cache.lru import TierCounters
from embedmesh.services.encoder_cache.metrics import L2_CORRUPTED, L2_REJECTED
from embedmesh.services.encoder_cache.resp import DISCARD, FILLED, RespPool, plain_params

__all__ = ["RedisTier", "RedisCounters", "integrity_key", "CHUNK_BYTES"]

log = get_logger(__name__)

_MAGIC = b"EMC2"
_DIGEST_BYTES = 32
CHUNK_BYTES = 1 << 20
_FIRST_READ = 256 << 10
"""Bytes of the first chunk read with the header, on speculation: a small entry is whole in one round trip, and a
lookup that declines a large one (``want``) has moved little."""
_READ_BATCH = 4
"""Chunks per MGET after the first: Redis builds a reply whole before sending it, and a 16 MiB reply costs it ~2x the
CPU of four 4 MiB ones (fresh reply buffers), more than the extra round trips."""
_MAX_HEADER_BYTES = 4096
"""A header is ~100 bytes; a longer value under a header key is damage, and is not read."""
_MIN_BYTES_PER_SECOND = 50e6
"""A call moving n bytes may take ``timeout_seconds + n / this`` before Redis counts as hung."""
_KDF_CONTEXT = "embedmesh 2025 encoder-cache L2 entry integrity v1"



@dataclass
class RedisCounters(TierCounters):
    corrupted: int = 0
    unavailable: int = 0
    rejected: int = 0
    skipped: int = 0
    """Reads declined after the header (the entry's size class reads faster by recomputing; see ``size_rule``)."""


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
        self._timeout = timeout_seconds
        # Bulk reads and writes go through a lean RESP client that moves chunks straight between the socket and the
        # array (see ``resp``); URLs it does not handle (TLS, RESP3, other options) use redis-py for those too.
        params = plain_params(url) if fastpath.enabled() else None  # off: redis-py for everything
        self._pool: RespPool | None = RespPool(params, timeout_seconds) if params is not None else None
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
        if self._pool is not None:
            self._pool.close()
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

    def _hasher(self, key: str, dtype: int, shape: tuple[int, ...]) -> Any:
        """BLAKE3 (keyed with the mesh token when there is one) over (key, dtype, shape), ready for the bytes."""
        h = blake3.blake3(key=self._key) if self._key is not None else blake3.blake3()
        k = key.encode()
        h.update(struct.pack(f"<Q{len(k)}sII{len(shape)}q", len(k), k, dtype, len(shape), *shape))
        return h

    def _digest(self, key: str, dtype: int, shape: tuple[int, ...], data: bytes | memoryview) -> bytes:
        h = self._hasher(key, dtype, shape)
        h.update(data)
        return bytes(h.digest(_DIGEST_BYTES))

    def _deadline(self, nbytes: int) -> float:
        """How long one call moving ``nbytes`` may take before Redis counts as hung."""
        return self._timeout + nbytes / _MIN_BYTES_PER_SECOND

    async def put(self, key: str, arr: np.ndarray, dtype: int, ttl_seconds: int) -> bool:
        if self._skip():
            self.counters.unavailable += 1
            return False
        data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [data]
        shape = tuple(int(d) for d in arr.shape)
        header = _MAGIC + struct.pack(f"<II{len(shape)}qQI", dtype, len(shape), *shape, len(data), len(chunks))
        header += self._digest(key, dtype, shape, data)
        base = self.prefix + key
        try:
            if self._pool is not None:
                await self._put_resp(base, chunks, header, ttl_seconds, len(data))
            else:
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

    async def _put_resp(self, base: str, chunks: list[memoryview], header: bytes, ttl: int, nbytes: int) -> None:
        """MULTI, every chunk then the header (SET .. EX ttl), EXEC; the chunks are written from the array itself."""
        assert self._pool is not None
        commands: list[list[Any]] = [["MULTI"]]
        commands += [["SET", f"{base}:c{i}", c, "EX", ttl] for i, c in enumerate(chunks)]
        commands += [["SET", f"{base}:h", header, "EX", ttl], ["EXEC"]]
        conn = await self._pool.acquire()
        try:
            replies = await conn.call(commands, timeout=self._deadline(nbytes))
        finally:
            self._pool.release(conn)
        results = replies[-1] if isinstance(replies[-1], list) else []
        for r in [*replies, *results]:
            if isinstance(r, Exception):
                raise r
        if replies[-1] is None:
            raise self._refused[0]("EXEC aborted")

    async def get(self, key: str, want: Callable[[int], bool] | None = None) -> tuple[np.ndarray, int] | None:
        """The entry, or None (absent, damaged, Redis away). ``want(nbytes)``, asked once the header has given the
        entry's size, may decline the transfer: then the read is a miss counted as ``skipped``."""
        if self._skip():
            self.counters.unavailable += 1
            self.counters.misses += 1
            return None
        base = self.prefix + key
        read = _EntryRead(self, key, want, _FIRST_READ if self._pool is not None else None)
        try:
            if self._pool is not None:
                await self._get_resp(base, read)
            else:
                header, first = await self._client.mget([f"{base}:h", f"{base}:c0"])
                read.header(header)
                read.feed(0, first)
                for first in range(1, read.nchunks, _READ_BATCH):
                    if read.state != _READING:
                        break
                    last = min(first + _READ_BATCH, read.nchunks)
                    parts = await self._client.mget([f"{base}:c{i}" for i in range(first, last)])
                    for i, part in enumerate(parts, start=first):
                        read.feed(i, part)
        except self._errors as e:
            self._fail("get", e)
            self.counters.misses += 1
            return None
        self._up()
        if read.state == _ABSENT:
            self.counters.misses += 1
            return None
        if read.state == _SKIPPED:
            self.counters.skipped += 1
            self.counters.misses += 1
            return None
        got = read.result()
        if got is None:
            return await self._corrupt(key, read.why)
        self.counters.hits += 1
        return got

    async def _get_resp(self, base: str, read: _EntryRead) -> None:
        """One round trip for the header and, on speculation, the first ``_FIRST_READ`` bytes (all of a small
        entry); then the rest, ``_READ_BATCH`` chunks per round trip. Bodies land in the result array and are
        digested as they arrive."""
        assert self._pool is not None

        def sink_first(i: int, n: int) -> Any:
            if i == 0:
                return None if n <= _MAX_HEADER_BYTES else DISCARD
            return read.sink(0, n)

        def on_first(i: int, v: Any) -> None:
            if i == 0:
                read.header(v)
            else:
                read.arrived(0, v)

        conn = await self._pool.acquire()
        try:
            replies = await conn.call([["GET", f"{base}:h"], ["GETRANGE", f"{base}:c0", 0, _FIRST_READ - 1]],
                                      timeout=self._deadline(_FIRST_READ), sink_for=sink_first, on_bulk=on_first)
            _check(replies, read)
            piece = 1
            while piece < len(read.pieces) and read.state == _READING:
                start, commands = piece, []
                if read.split and piece == 1:  # the rest of the first chunk
                    commands.append(["GETRANGE", f"{base}:c0", _FIRST_READ, -1])
                    piece += 1
                count = min(_READ_BATCH - len(commands), len(read.pieces) - piece)
                if count > 0:
                    chunk = piece - 1 if read.split else piece
                    commands.append(["MGET", *[f"{base}:c{chunk + j}" for j in range(count)]])
                    piece += count
                replies = await conn.call(
                    commands, timeout=self._deadline(sum(len(v) for v in read.pieces[start:piece])),
                    sink_for=lambda i, n, start=start: read.sink(start + i, n),
                    on_bulk=lambda i, v, start=start: read.arrived(start + i, v))
                _check(replies, read)
        finally:
            self._pool.release(conn)

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
        """Redis's ``maxmemory`` (0 when unknown). While Redis is down this call can be the probe (``_skip``), so an
        answer marks it up again: a Stats poller taking the probe's turn must not keep L2 reported away."""
        if self._skip():
            return 0
        try:
            cfg = await self._client.config_get("maxmemory")
        except self._refused:
            self._up()  # Redis answered: CONFIG may be disabled on managed Redis
            return 0
        except self._errors as e:
            self._down(e)
            return 0
        self._up()
        return int(cfg.get(b"maxmemory", cfg.get("maxmemory", 0)) or 0)


def _check(replies: list[Any], read: _EntryRead) -> None:
    """Raise an error reply, except a key of another type where a chunk or header should be: that entry is damaged."""
    for r in replies:
        if isinstance(r, Exception):
            if "WRONGTYPE" in str(r):
                read.damaged(str(r)[:100])
                continue
            raise r


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


_ABSENT, _SKIPPED, _CORRUPT, _READING, _START = "absent", "skipped", "corrupt", "reading", "start"


class _EntryRead:
    """One L2 read: the header, then each chunk written into one array and digested in order as it arrives."""

    def __init__(self, tier: RedisTier, key: str, want: Callable[[int], bool] | None,
                 first_read: int | None = None) -> None:
        self.tier, self.key, self.want = tier, key, want
        self.state = _START
        self.why = ""
        self.nbytes = 0
        self.nchunks = 0
        self.pieces: list[memoryview] = []
        """Where the bytes go, in digest order: the chunks, the first one split at ``first_read`` when given."""
        self.split = False
        self._first_read = first_read
        self._next = 0

    def damaged(self, why: str) -> None:
        """The entry is not usable (unless it was already found absent or declined)."""
        if self.state in (_READING, _START):
            self.state, self.why = _CORRUPT, why

    def header(self, raw: Any) -> None:
        if raw is None:
            self.state = _ABSENT
            return
        parsed = _parse_header(raw) if isinstance(raw, bytes) else None
        if parsed is None:
            self.damaged("bad header")
            return
        self._dtype, self._shape, self.nbytes, self.nchunks, self._digest = parsed
        if self.want is not None and not self.want(self.nbytes):
            self.state = _SKIPPED
            return
        self._out = np.empty(self.nbytes, np.uint8)
        whole = memoryview(self._out)
        self.pieces = [whole[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES] for i in range(self.nchunks)]
        first = self._first_read
        if first is not None and len(self.pieces[0]) > first:
            self.pieces[:1] = [self.pieces[0][:first], self.pieces[0][first:]]
            self.split = True
        self._hasher = self.tier._hasher(self.key, self._dtype, self._shape)
        self.state = _READING

    def sink(self, i: int, n: int) -> Any:
        """Where piece ``i`` of ``n`` bytes goes: its slice of the result, or DISCARD when it is not wanted."""
        if self.state != _READING:
            return DISCARD
        if i >= len(self.pieces) or n != len(self.pieces[i]):
            self.damaged(f"piece {i}: {n} bytes, expected {len(self.pieces[i]) if i < len(self.pieces) else 0}")
            return DISCARD
        return self.pieces[i]

    def arrived(self, i: int, value: Any) -> None:
        if self.state != _READING:
            return
        if value is None:
            self.damaged(f"piece {i} missing")
        elif value is FILLED and i == self._next:
            self._hasher.update(self.pieces[i])
            self._next += 1
        else:
            self.damaged(f"piece {i} not read")

    def feed(self, i: int, data: bytes | None) -> None:
        """Chunk ``i`` as redis-py returned it (no split first chunk: pieces are the chunks)."""
        if data is None:
            self.arrived(i, None)
            return
        sink = self.sink(i, len(data))
        if sink is not DISCARD:
            sink[:] = data
            self.arrived(i, FILLED)

    def result(self) -> tuple[np.ndarray, int] | None:
        if self.state != _READING:
            return None
        if self._next != len(self.pieces):
            self.why = "missing chunk"
            return None
        if not hmac.compare_digest(self._hasher.digest(_DIGEST_BYTES), self._digest):
            self.why = "integrity digest mismatch"
            return None
        arr = self._out.view(numpy_dtype(self._dtype)).reshape(self._shape)
        arr.flags.writeable = False
        return arr, self._dtype

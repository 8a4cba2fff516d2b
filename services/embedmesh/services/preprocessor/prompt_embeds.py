"""Prompt embeddings in the preprocessor, one straight line from what arrived to rows a worker can take:

    RawEmbeds            what the request carried: a wire tensor (``core.transport.WireTensor``: its header, its
                         bytes, whether they are still arriving), serialized bytes, or an upload id
      -> read()          a wire tensor becomes an array over the request's bytes (a view of the received buffer,
                         never a copy); rows still arriving keep their ``Arriving`` mark
      -> decode()        serialized bytes (torch.save zip or safetensors) -> (array, dtype), ``core.tensor_codec``,
                         off the event loop when large; an upload id is looked up in the caller's namespace
      -> validate        ``core.embeds.validate_embeds``: the rules the worker applies again, cast to the model dtype
      -> cache           a serialized payload's validated rows, kept under a key only the server computes
      -> fit             rows + max_tokens within the model's context (``core.context``)

``EmbedsResolver`` runs the line for one request (it knows the model's shape, the byte cap and ``max_tokens``).
This module imports only core and the encoder cache: nothing here calls back into the preprocessor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from embedmesh.core.context import ROWS, check_context
from embedmesh.core.embeds import ModelSpec, validate_embeds
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import check_cap, decode_tensor_bytes
from embedmesh.core.transport.received import Arriving, WireTensor
from embedmesh.services.encoder_cache.keys import payload_key
from embedmesh.services.encoder_cache.service import lookup_upload
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache

__all__ = ["RawEmbeds", "EmbedsResolver", "read", "decode"]

_THREAD_BYTES = 1 << 20
"""Serialized payloads larger than this decode in a thread, keeping the event loop free."""


@dataclass(frozen=True)
class RawEmbeds:
    """One prompt_embeds entry as it arrived: a wire tensor not read yet, serialized bytes, an already-typed array
    (``arriving``: its bytes are still arriving, checked as they land), or an upload id. All unset: the client set
    none of them (refused by ``read``)."""

    encoded: bytes | memoryview | None = None
    array: np.ndarray | None = None
    dtype: int = 0
    cache_id: str = ""
    tensor: WireTensor | None = None
    arriving: Arriving | None = None


def read(raw: RawEmbeds, field: str) -> RawEmbeds:
    """A wire tensor -> its array and dtype (shape, dtype and byte length checked, no copy); the others as they are.
    Refuses an entry with nothing set (REQUIRED)."""
    if raw.tensor is not None:
        arr, dtype = raw.tensor.read(field)
        return RawEmbeds(array=arr, dtype=dtype, arriving=raw.tensor.arriving)
    if raw.encoded is None and raw.array is None and not raw.cache_id:
        raise InvalidArgument(f"{field}: neither tensor nor encoded is set", field=field, reason="REQUIRED")
    return raw


async def decode(data: bytes | memoryview, *, max_bytes: int, field: str) -> tuple[np.ndarray, int]:
    """Serialized bytes -> (array, DataType), refused past ``max_bytes`` before anything is allocated."""
    if len(data) > _THREAD_BYTES:
        return await asyncio.to_thread(decode_tensor_bytes, data, max_bytes=max_bytes, field=field)
    return decode_tensor_bytes(data, max_bytes=max_bytes, field=field)


class EmbedsResolver:
    """Turns a RawEmbeds into validated rows in the model dtype.

    Serialized payloads are decoded and validated once per distinct payload and model shape: the rows are cached
    under a key only the server computes (``v1:payload:<dtype>:<hidden>:`` + BLAKE3-256 of the bytes, a key space
    no cache RPC can write), so a repeated prompt skips unpickling and the NaN/Inf scan (and, with Redis as L2, so
    do the other replicas; L2 entries are integrity-checked on read). Errors are never cached.
    Upload ids resolve in the calling tenant's namespace only and are validated again with this model's rules on
    every use; unknown, expired or another tenant's ids are a NotFound naming the field.
    """

    def __init__(self, cache: TieredCache, spec: ModelSpec, max_bytes: int, max_tokens: int) -> None:
        self.cache = cache
        self.spec = spec
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens

    async def __call__(self, raw: RawEmbeds, field: str) -> np.ndarray:
        """Validated ``(rows, hidden)`` in the model dtype, checked against the context with ``max_tokens``, every
        byte of them arrived."""
        rows, arriving = await self.rows(raw, field)
        if arriving is not None:
            await arriving.wait(arriving.nbytes)
        return rows

    async def rows(self, raw: RawEmbeds, field: str) -> tuple[np.ndarray, Arriving | None]:
        """``__call__``'s rows without waiting for rows still arriving (their bytes are checked as they land, the
        other rules are applied here): with their ``Arriving`` mark, to wait on before reading them."""
        raw = read(raw, field)
        arriving = None
        if raw.cache_id:
            rows = await self._upload(raw.cache_id, field)
        elif raw.encoded is not None:
            rows = await self._payload(raw.encoded, field)
        elif raw.array is not None:
            check_cap(field, raw.array.nbytes, self.max_bytes)
            arriving = raw.arriving
            if arriving is not None and raw.dtype != self.spec.dtype:  # a cast needs every value: wait for them
                await arriving.wait(arriving.nbytes)
                arriving = None
            rows = validate_embeds(raw.array, raw.dtype, self.spec, field=field, max_tokens=self.max_tokens,
                                   scanned=arriving is not None)
        else:
            raise InvalidArgument(f"{field}: no tensor given", field=field, reason="REQUIRED")
        check_context(int(rows.shape[0]), self.max_tokens, self.spec.max_context_tokens, field=field, wording=ROWS)
        return rows, arriving

    async def _upload(self, cache_id: str, field: str) -> np.ndarray:
        value = await lookup_upload(self.cache, cache_id, field)
        return validate_embeds(value.array, value.dtype, self.spec, field=field, max_tokens=self.max_tokens)

    async def _payload(self, data: bytes | memoryview, field: str) -> np.ndarray:
        async def decode_and_validate() -> CachedTensor:
            arr, dtype = await decode(data, max_bytes=self.max_bytes, field=field)
            # The context is checked per request by the caller: the cached rows only depend on the model's shape.
            rows = validate_embeds(arr, dtype, self.spec, field=field, max_tokens=0)
            rows.setflags(write=False)  # shared by every hit (and its block hashes memoized, core.block_hash)
            return CachedTensor(rows, self.spec.dtype)

        # The key covers what validation depends on, so a hit is rows ready for this model.
        key = payload_key(f"payload:{self.spec.dtype}:{self.spec.hidden_size}", data)
        return (await self.cache.get_or_compute(key, decode_and_validate)).array

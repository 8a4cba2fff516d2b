"""Turn a completion request's prompts into engine prompts: tokenize text, decode and validate embeddings,
check token ids and context length. Choice order: embeddings prompts first, then token-id prompts, then text."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedmesh.core.embeds import ModelSpec, validate_embeds
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensor_codec import check_cap, decode_tensor_bytes
from embedmesh.services.encoder_cache.keys import payload_key
from embedmesh.services.encoder_cache.service import lookup_upload
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache

__all__ = ["EmbedsResolver", "Piece", "Prompt", "RawEmbeds", "Tokenizer", "build_prompts", "check_context"]


@dataclass(frozen=True)
class RawEmbeds:
    """One prompt_embeds entry as it arrived: serialized bytes, an already-typed raw tensor, or an upload id."""

    encoded: bytes | memoryview | None = None
    array: np.ndarray | None = None
    dtype: int = 0
    cache_id: str = ""


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
        """Validated ``(rows, hidden)`` in the model dtype; serialized payloads are decoded and checked once."""
        if raw.cache_id:
            value = await lookup_upload(self.cache, raw.cache_id, field)
            rows = validate_embeds(value.array, value.dtype, self.spec, field=field, max_tokens=self.max_tokens)
        elif raw.encoded is not None:
            data = raw.encoded

            async def decode_and_validate() -> CachedTensor:
                if len(data) > 1 << 20:  # keep the event loop free while a big payload decodes
                    arr, dtype = await asyncio.to_thread(decode_tensor_bytes, data, max_bytes=self.max_bytes,
                                                         field=field)
                else:
                    arr, dtype = decode_tensor_bytes(data, max_bytes=self.max_bytes, field=field)
                # Context length is checked per request below: the cached rows only depend on the model's shape.
                rows = validate_embeds(arr, dtype, self.spec, field=field, max_tokens=0)
                return CachedTensor(rows, self.spec.dtype)

            # The key covers what validation depends on, so a hit is rows ready for this model.
            key = payload_key(f"payload:{self.spec.dtype}:{self.spec.hidden_size}", data)
            rows = (await self.cache.get_or_compute(key, decode_and_validate)).array
        elif raw.array is not None:
            check_cap(field, raw.array.nbytes, self.max_bytes)
            rows = validate_embeds(raw.array, raw.dtype, self.spec, field=field, max_tokens=self.max_tokens)
        else:
            raise InvalidArgument(f"{field}: no tensor given", field=field, reason="REQUIRED")
        return check_rows_context(rows, self.spec, field, self.max_tokens)


def check_rows_context(rows: np.ndarray, spec: ModelSpec, field: str, max_tokens: int) -> np.ndarray:
    if rows.shape[0] + max_tokens > spec.max_context_tokens:
        raise InvalidArgument(
            f"{field}: {rows.shape[0]} rows + max_tokens {max_tokens} exceed the model's context of "
            f"{spec.max_context_tokens} positions",
            field=field, reason="CONTEXT_OVERFLOW",
        )
    return rows


Piece = tuple[int, ...] | np.ndarray
"""Token ids, or embedding rows (rows, hidden) in the model dtype."""


@dataclass(frozen=True)
class Prompt:
    """What a worker receives for one prompt: pieces of token ids and embedding rows, in order."""

    pieces: tuple[Piece, ...]

    @classmethod
    def of_ids(cls, ids: tuple[int, ...]) -> Prompt:
        return cls((ids,))

    @classmethod
    def of_embeds(cls, rows: np.ndarray) -> Prompt:
        return cls((rows,))

    def __len__(self) -> int:
        return sum(len(p) if isinstance(p, tuple) else int(p.shape[0]) for p in self.pieces)


class Tokenizer:
    """The model's fast tokenizer, loaded from tokenizer.json (no transformers, no torch)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(folder / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: tuple[int, ...] | list[int]) -> str:
        """Text of token ids, special tokens included (what ``echo`` shows for a token-id prompt)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


async def build_prompts(
    *,
    texts: list[str],
    token_prompts: list[list[int]],
    embeds: list[RawEmbeds],
    spec: ModelSpec,
    vocab_size: int,
    max_tokens: int,
    resolve: EmbedsResolver,
    tokenizer: Tokenizer,
    max_prompts: int,
    prefix: RawEmbeds | None = None,
) -> list[Prompt]:
    """Validate every prompt; raise InvalidArgument naming the first bad one."""
    # The openai SDK requires `prompt`; vLLM's own example sends prompt="" beside prompt_embeds. Drop empties then.
    if embeds or token_prompts:
        texts = [t for t in texts if t != ""]
    total = len(texts) + len(token_prompts) + len(embeds)
    if total == 0:
        raise InvalidArgument("either prompt or prompt_embeds is required", field="prompt", reason="MISSING_PROMPT")
    if total > max_prompts:
        raise InvalidArgument(f"at most {max_prompts} prompts per request, got {total}", field="prompt",
                              reason="TOO_MANY_PROMPTS")
    out: list[Prompt] = []
    for i, raw in enumerate(embeds):
        field = "prompt_embeds" if len(embeds) == 1 else f"prompt_embeds[{i}]"
        out.append(Prompt.of_embeds(await resolve(raw, field)))
    for i, ids in enumerate(token_prompts):
        field = "prompt" if len(token_prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise InvalidArgument(f"{field}: token id list is empty", field=field, reason="EMPTY_PROMPT")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise InvalidArgument(f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                  field=field, reason="TOKEN_OUT_OF_RANGE")
        out.append(check_context(Prompt.of_ids(tuple(ids)), spec, field, max_tokens))
    for i, text in enumerate(texts):
        field = "prompt" if len(texts) == 1 else f"prompt[{i}]"
        if text == "":
            raise InvalidArgument(f"{field}: empty text prompt", field=field, reason="EMPTY_PROMPT")
        out.append(check_context(Prompt.of_ids(tokenizer.encode(text)), spec, field, max_tokens))
    if prefix is not None:
        rows = await resolve(prefix, "prompt_embeds_prefix")
        out = [check_context(Prompt((rows, *p.pieces)), spec, "prompt_embeds_prefix", max_tokens) for p in out]
    return out


def check_context(p: Prompt, spec: ModelSpec, field: str, max_tokens: int) -> Prompt:
    if len(p) == 0:
        raise InvalidArgument(f"{field}: the prompt tokenizes to nothing", field=field, reason="EMPTY_PROMPT")
    if len(p) + max_tokens > spec.max_context_tokens:
        raise InvalidArgument(
            f"{field}: {len(p)} prompt tokens + max_tokens {max_tokens} exceed the model's context of "
            f"{spec.max_context_tokens}",
            field=field,
            reason="CONTEXT_OVERFLOW",
        )
    return p

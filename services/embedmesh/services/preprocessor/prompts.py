"""Turn a completion request's prompts into engine prompts: tokenize text, resolve embeddings (``prompt_embeds``),
check token ids and context length. Choice order: embeddings prompts first, then token-id prompts, then text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedmesh.core.context import TOKENS, check_context
from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.transport.received import Arriving
from embedmesh.services.preprocessor.prompt_embeds import EmbedsResolver, RawEmbeds
from embedmesh.services.preprocessor.token_cache import DEFAULT_CACHE_BYTES, TokenCache, safe_splitter

__all__ = ["Piece", "Prompt", "Tokenizer", "build_prompts", "check_prompt"]


Piece = tuple[int, ...] | np.ndarray
"""Token ids, or embedding rows (rows, hidden) in the model dtype."""


@dataclass(frozen=True)
class Prompt:
    """What a worker receives for one prompt: pieces of token ids and embedding rows, in order. ``arriving``: the
    prompt is one piece of rows whose bytes are still arriving from the client (checked as they land): wait for
    them before reading or sending them."""

    pieces: tuple[Piece, ...]
    arriving: Arriving | None = None

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

    def __init__(self, folder: Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(folder / "tokenizer.json"))
        added = self._tok.get_added_tokens_decoder()
        splitter = safe_splitter(list(added.values()))
        ids = {t.content: i for i, t in added.items() if self._raw(t.content) == [i]}
        if splitter is not None and not self._splits_exactly([t.content for t in added.values()]):
            splitter = None
        self.cache = TokenCache(self._raw, splitter, cache_bytes, added=ids)
        """Token ids of rendered text pieces by content (``token_cache``): what a prompt shares with earlier ones
        (a system prompt, earlier turns) is not tokenized again."""
        probe = "a b"
        self._post_adds = self._tok.encode(probe).ids != self._tok.encode(probe, add_special_tokens=False).ids
        """Whether the post-processor adds special tokens (a BOS...): then text prompts are tokenized uncached."""

    def _raw(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids  # type: ignore[no-any-return]

    def _splits_exactly(self, added: list[str]) -> bool:
        """Whether text around added tokens tokenizes the same alone as in the whole (the cache's premise): not so
        where the pre-tokenizer treats the start of the text apart (a Metaspace with ``prepend_scheme="first"``)."""
        for content in added[:8]:
            pieces = ["Hi there", content, " a b\n", content, "c"]
            if self._raw("".join(pieces)) != [i for p in pieces for i in self._raw(p)]:
                return False
        return True

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        if not add_special_tokens or not self._post_adds:
            return self.cache.encode(text)
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
        rows, arriving = await resolve.rows(raw, field)
        out.append(Prompt((rows,), arriving))
    for i, ids in enumerate(token_prompts):
        field = "prompt" if len(token_prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise InvalidArgument(f"{field}: token id list is empty", field=field, reason="EMPTY_PROMPT")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise InvalidArgument(f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                                  field=field, reason="TOKEN_OUT_OF_RANGE")
        out.append(check_prompt(Prompt.of_ids(tuple(ids)), spec, field, max_tokens))
    for i, text in enumerate(texts):
        field = "prompt" if len(texts) == 1 else f"prompt[{i}]"
        if text == "":
            raise InvalidArgument(f"{field}: empty text prompt", field=field, reason="EMPTY_PROMPT")
        out.append(check_prompt(Prompt.of_ids(tokenizer.encode(text)), spec, field, max_tokens))
    if prefix is not None:
        rows = await resolve(prefix, "prompt_embeds_prefix")
        for p in out:
            if p.arriving is not None:  # a prompt put behind a prefix is sent whole
                await p.arriving.wait(p.arriving.nbytes)
        out = [check_prompt(Prompt((rows, *p.pieces)), spec, "prompt_embeds_prefix", max_tokens) for p in out]
    return out


def check_prompt(p: Prompt, spec: ModelSpec, field: str, max_tokens: int) -> Prompt:
    """A built prompt has at least one position (EMPTY_PROMPT) and fits the context with ``max_tokens``."""
    if len(p) == 0:
        raise InvalidArgument(f"{field}: the prompt tokenizes to nothing", field=field, reason="EMPTY_PROMPT")
    check_context(len(p), max_tokens, spec.max_context_tokens, field=field, wording=TOKENS)
    return p

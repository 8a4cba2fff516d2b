"""The preprocessor's prompt cache: token ids of the pieces of rendered text, kept by content.

A chat turn re-renders the whole conversation and tokenizes all of it again: at turn 10 of a conversation with an
8k-token system prompt, tokenizing is most of the preprocessor's work (~75 ms for 9k tokens on this machine), for a
text that is 90 % what the previous turn sent. The rendered text is cut at the tokenizer's added tokens
(``<|im_start|>``, ``<|im_end|>``, ...), which are safe boundaries: the tokenizer itself splits the text there
before anything else and tokenizes the pieces between them independently, so the ids of the pieces, concatenated,
are the ids of the whole. Each piece's ids are cached under the piece's text, so a system prompt, an earlier turn
or a shared document is tokenized once while it stays cached, whoever sends it.

That equality is a property of the tokenizer, checked at load: the split is used only when every added token is
matched as is (not normalized, no ``lstrip``/``rstrip``/``single_word``), otherwise (or with a 0-byte budget) the
text is tokenized whole, uncached. ``tests/unit/services/preprocessor/test_token_cache.py`` checks with hypothesis
that cached ids equal freshly computed ids for the shipped template's renderings (tools, embeddings placeholders,
special tokens typed in text).

A piece that is one added token is its id, known at load (``added``: the tokenizer's own ids of each added token's
text, checked there), with no lookup; every other piece, short ones too, is looked up (a tokenizer call costs
3-11 us even for ``"\n"`` or ``"assistant\n"``, a lookup under 1 us), and all of a text's lookups take the lock
once. A text shorter than ``MIN_PIECE_CHARS`` is tokenized whole, without the cache.

Bounded in bytes (the pieces' UTF-8-ish size plus 8 bytes per id), least recently used first out. Hits and misses
count pieces (``embedmesh_preprocessor_prompt_cache_*``); cached text is the mesh's clients' text, so the cache is
per process and never shared (a hit reveals nothing: it returns the ids the text would have had).
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge

__all__ = ["TokenCache", "DEFAULT_CACHE_BYTES", "MIN_PIECE_CHARS", "safe_splitter"]

DEFAULT_CACHE_BYTES = 64 << 20
MIN_PIECE_CHARS = 64
"""Shorter texts are tokenized directly, whole."""
_ENTRY_OVERHEAD = 120
"""Bytes counted per entry beyond its text and ids (dict slot, tuple, str headers)."""

HITS = Counter("embedmesh_preprocessor_prompt_cache_hits_total", "Pieces of rendered prompt text whose token ids "
               "came from the prompt cache")
MISSES = Counter("embedmesh_preprocessor_prompt_cache_misses_total", "Pieces of rendered prompt text tokenized "
                 "and then cached")
HIT_TOKENS = Counter("embedmesh_preprocessor_prompt_cache_hit_tokens_total", "Token ids taken from the prompt cache "
                     "instead of tokenizing")
CACHED_BYTES = Gauge("embedmesh_preprocessor_prompt_cache_bytes", "Bytes the prompt cache holds (all tokenizers)")


def safe_splitter(added_tokens: Sequence[Any]) -> re.Pattern[str] | None:
    """A pattern splitting text at the added tokens (kept as pieces), or None when splitting there is not known to
    give the same ids (an added token with lstrip/rstrip/single_word, or matched after normalization)."""
    contents = []
    for token in added_tokens:
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return None
        contents.append(token.content)
    if not contents:
        return None
    # Longest first: at one position the tokenizer takes the longest added token (leftmost-longest).
    alternatives = "|".join(re.escape(c) for c in sorted(set(contents), key=len, reverse=True))
    return re.compile(f"({alternatives})")


class TokenCache:
    """Token ids of text pieces by content (see the module docstring). Thread-safe: prompts are built in threads."""

    def __init__(self, encode: Callable[[str], Sequence[int]], splitter: re.Pattern[str] | None,
                 max_bytes: int = DEFAULT_CACHE_BYTES, added: Mapping[str, int] | None = None) -> None:
        self._encode = encode
        self._splitter = splitter if max_bytes > 0 else None
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        """LRU order: the most recently used piece at the end."""
        self._added = {content: (i,) for content, i in (added or {}).items()}
        """The id of each piece that is exactly one added token (the caller checked that the tokenizer agrees)."""
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._splitter is not None

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def encode(self, text: str) -> tuple[int, ...]:
        """The ids of ``text`` without the post-processor's special tokens (``add_special_tokens=False``)."""
        if self._splitter is None or len(text) < MIN_PIECE_CHARS:
            return tuple(self._encode(text))
        added, entries = self._added, self._entries
        found: list[tuple[int, ...] | str] = []  # ids, or the piece itself where it is still to be tokenized
        hits = hit_tokens = 0
        with self._lock:
            for piece in self._splitter.split(text):
                if not piece:
                    continue
                ids = added.get(piece)
                if ids is None:
                    ids = entries.get(piece)
                    if ids is None:
                        found.append(piece)
                        continue
                    entries.move_to_end(piece)
                    hits += 1
                    hit_tokens += len(ids)
                found.append(ids)
        if hits:
            HITS.inc(hits)
            HIT_TOKENS.inc(hit_tokens)
        out: list[int] = []
        for item in found:
            out.extend(self._miss(item) if isinstance(item, str) else item)
        return tuple(out)

    def _miss(self, piece: str) -> tuple[int, ...]:
        ids = tuple(self._encode(piece))
        MISSES.inc()
        cost = len(piece) + 8 * len(ids) + _ENTRY_OVERHEAD
        if cost > self._max_bytes // 4:  # one piece never takes most of the cache
            return ids
        with self._lock:
            if piece not in self._entries:
                self._entries[piece] = ids
                self._bytes += cost
                CACHED_BYTES.inc(cost)
                while self._bytes > self._max_bytes:
                    old, old_ids = self._entries.popitem(last=False)
                    freed = len(old) + 8 * len(old_ids) + _ENTRY_OVERHEAD
                    self._bytes -= freed
                    CACHED_BYTES.dec(freed)
        return ids

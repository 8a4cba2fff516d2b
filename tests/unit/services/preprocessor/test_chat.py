"""Chat prompt building: the template renders as transformers renders it, embeddings parts land where they stand,
the ids sent to the worker are transformers' ids for any conversation (cold and from the prompt cache), and the
conversation rules give errors naming the part."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.services.preprocessor.chat import (
    PLACEHOLDER,
    ChatMessage,
    ChatPart,
    ChatTemplate,
    build_chat_prompt,
)
from embedmesh.services.preprocessor.prompts import Tokenizer
from embedmesh.tensor.v1 import tensor_pb2


@pytest.fixture(scope="module")
def folder() -> Any:
    from embedmesh.models import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def hf_tok(folder: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def build(folder: Any) -> Any:
    template, tok = ChatTemplate(folder), Tokenizer(folder)
    spec = ModelSpec(hidden_size=576, max_context_tokens=8192, dtype=tensor_pb2.DATA_TYPE_FP32)

    def run(messages: list[ChatMessage], max_tokens: int = 16) -> Any:
        return build_chat_prompt(messages, template=template, tokenizer=tok, spec=spec, max_tokens=max_tokens)

    return run


def text(role: str, *texts: str) -> ChatMessage:
    return ChatMessage(role, tuple(ChatPart(text=t) for t in texts))


def rows(n: int, fill: float = 0.5) -> np.ndarray:
    return np.full((n, 576), fill, dtype=np.float32)


CONVERSATIONS = [
    [text("user", "What is the capital of France?")],
    [text("system", "You are terse."), text("user", "Hi there")],
    [text("user", "Hello"), text("assistant", "Hi! How can I help?"), text("user", "Tell me a joke.")],
]


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_text_only_matches_transformers_apply_chat_template(build: Any, hf_tok: Any, conv: list[ChatMessage]) -> None:
    prompt = build(conv)
    expected = hf_tok.apply_chat_template(
        [{"role": m.role, "content": m.parts[0].text} for m in conv], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    assert len(prompt.pieces) == 1
    assert list(prompt.pieces[0]) == list(expected)


def test_embeddings_part_lands_between_the_text_around_it(build: Any, hf_tok: Any) -> None:
    msg = ChatMessage("user", (ChatPart(text="Before"), ChatPart(embeds=rows(3)), ChatPart(text="After")))
    prompt = build([msg])
    kinds = ["ids" if isinstance(p, tuple) else "rows" for p in prompt.pieces]
    assert kinds == ["ids", "rows", "ids"]
    assert prompt.pieces[1].shape == (3, 576)
    # Parts of one message are joined with a newline: the text around the slot ends/starts with it.
    before = hf_tok.decode(list(prompt.pieces[0]))
    after = hf_tok.decode(list(prompt.pieces[2]))
    assert before.endswith("user\nBefore\n")
    assert after.startswith("\nAfter<|im_end|>")
    assert len(prompt) == len(prompt.pieces[0]) + 3 + len(prompt.pieces[2])


def test_several_embeddings_parts_keep_their_order(build: Any) -> None:
    msgs = [
        ChatMessage("system", (ChatPart(embeds=rows(2, 0.1)),)),
        ChatMessage("user", (ChatPart(embeds=rows(4, 0.2)), ChatPart(text="and"), ChatPart(embeds=rows(1, 0.3)))),
    ]
    slots = [p for p in build(msgs).pieces if not isinstance(p, tuple)]
    assert [s.shape[0] for s in slots] == [2, 4, 1]
    assert [float(s[0, 0]) for s in slots] == pytest.approx([0.1, 0.2, 0.3])


@pytest.mark.parametrize(
    "messages,field,reason",
    [
        ([], "messages", "EMPTY"),
        ([text("wizard", "hi")], "messages[0].role", "UNKNOWN_ROLE"),
        ([text("user", f"please fill {PLACEHOLDER} here")], "messages[0].content", "PLACEHOLDER_IN_TEXT"),
        ([ChatMessage("user", (ChatPart(text="a"), ChatPart(text=PLACEHOLDER)))], "messages[0].content[1]",
         "PLACEHOLDER_IN_TEXT"),
        ([ChatMessage("user", (ChatPart(embeds=rows(8150)),))], "messages", "CONTEXT_OVERFLOW"),
    ],
)
def test_bad_conversations_name_the_part(build: Any, messages: list[ChatMessage], field: str,
                                         reason: str | None) -> None:
    with pytest.raises(InvalidArgument) as info:
        build(messages)
    assert info.value.field == field
    if reason:
        assert info.value.reason == reason


def test_forged_nonce_placeholder_is_plain_text(build: Any) -> None:
    prompt = build([text("user", "<|embedmesh:0000000000000000:0|>")])
    assert all(isinstance(p, tuple) for p in prompt.pieces)


# --- the ids sent to the worker: the reference is transformers' own rendering and tokenizer, never our cache --------

_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<|im_start", "im_end|>",
             "<|embedmesh:0123456789abcdef:0|>"]
_words = st.sampled_from(["Hello", " world", "\n", "  ", "é", "日本語", "🙂", "\t", "x" * 70, "The cat sat. " * 8,
                          "assistant\n", "{\"a\": 1}", "<", "|>", *_SPECIALS])
_chats = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                            st.lists(st.lists(_words, max_size=10).map("".join), min_size=1, max_size=3)),
                  min_size=1, max_size=6)


def _reference(hf_tok: Any, chat: list[tuple[str, list[str]]]) -> list[int]:
    """transformers' apply_chat_template on the same conversation (parts joined with a newline, as documented)."""
    return list(hf_tok.apply_chat_template([{"role": r, "content": "\n".join(parts)} for r, parts in chat],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=_chats)
def test_prompt_ids_equal_transformers_for_any_conversation_cold_and_cached(build: Any, hf_tok: Any,
                                                                            chat: Any) -> None:
    messages = [ChatMessage(r, tuple(ChatPart(text=t) for t in parts)) for r, parts in chat]
    want = _reference(hf_tok, chat)
    for _ in range(2):  # the first build fills the prompt cache, the second reads it
        prompt = build(messages)
        assert [i for p in prompt.pieces for i in p] == want
        assert all(isinstance(p, tuple) for p in prompt.pieces)


def test_growing_conversations_keep_their_ids_as_history_comes_from_the_cache(build: Any, hf_tok: Any) -> None:
    system = ("system", ["You are a careful assistant who answers in full sentences. " * 20])
    chat: list[tuple[str, list[str]]] = [system]
    for i in range(6):
        chat.append(("user", [f"Question {i}: what is {i} times {i}? Explain the steps. " * 3]))
        prompt = build([ChatMessage(r, tuple(ChatPart(text=t) for t in parts)) for r, parts in chat])
        assert list(prompt.pieces[0]) == _reference(hf_tok, chat)
        chat.append(("assistant", [f"It is {i * i}.\n"]))


def test_ids_around_an_embeddings_part_equal_transformers_on_each_side(build: Any, hf_tok: Any) -> None:
    mark = "\x00SLOT\x00"
    for before, after in [("Before", "After"), ("<|im_end|> typed", "x" * 90), ("日本語 " * 30, "🙂")]:
        msgs = [ChatMessage("system", (ChatPart(text="Be brief. " * 10),)),
                ChatMessage("user", (ChatPart(text=before), ChatPart(embeds=rows(2)), ChatPart(text=after)))]
        text = hf_tok.apply_chat_template([{"role": "system", "content": "Be brief. " * 10},
                                           {"role": "user", "content": f"{before}\n{mark}\n{after}"}],
                                          add_generation_prompt=True, tokenize=False)
        head, tail = text.split(mark)
        for _ in range(2):
            prompt = build(msgs)
            assert len(prompt.pieces) == 3 and prompt.pieces[1].shape == (2, 576)
            assert list(prompt.pieces[0]) == hf_tok(head, add_special_tokens=False).input_ids
            assert list(prompt.pieces[2]) == hf_tok(tail, add_special_tokens=False).input_ids

"""Chat completions with prompt_embeds content parts mixed with text, through the real mesh and the openai SDK."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import HIDDEN, MODEL, b64_of

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"


def chat(client: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 10)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def embeds_part(embeds_of: Any, text: str) -> dict[str, str]:
    return {"type": "prompt_embeds", "data": b64_of(embeds_of(text))}


def test_single_embeddings_part_equals_the_text(client: Any, embeds_of: Any, hf_model: Any) -> None:
    by_text = chat(client, [{"role": "user", "content": QUESTION}])
    by_embeds = chat(client, [{"role": "user", "content": [embeds_part(embeds_of, QUESTION)]}])
    assert by_text.choices[0].message.content
    assert by_embeds.choices[0].message.content == by_text.choices[0].message.content
    assert by_embeds.choices[0].message.role == "assistant"
    # usage = template tokens + embedding rows = the text conversation's token count
    assert by_embeds.usage.prompt_tokens == by_text.usage.prompt_tokens
    _, tok = hf_model
    expected_ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert by_text.usage.prompt_tokens == len(expected_ids)


def test_mixed_parts_join_with_newlines_like_vllm(client: Any, embeds_of: Any) -> None:
    parts = [{"type": "text", "text": "Answer briefly."}, embeds_part(embeds_of, QUESTION),
             {"type": "text", "text": "Thanks!"}]
    mixed = chat(client, [{"role": "user", "content": parts}])
    as_text = chat(client, [{"role": "user", "content": f"Answer briefly.\n{QUESTION}\nThanks!"}])
    assert mixed.choices[0].message.content == as_text.choices[0].message.content


def test_system_and_multi_turn_with_several_embeddings_parts(client: Any, embeds_of: Any) -> None:
    system = "You are a geography teacher."
    turns_text = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! Ask me anything."},
        {"role": "user", "content": QUESTION},
    ]
    turns_embeds = [
        {"role": "system", "content": [embeds_part(embeds_of, system)]},
        {"role": "user", "content": [embeds_part(embeds_of, "Hello!")]},
        {"role": "assistant", "content": "Hi! Ask me anything."},
        {"role": "user", "content": [embeds_part(embeds_of, QUESTION)]},
    ]
    a, b = chat(client, turns_text), chat(client, turns_embeds)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage.prompt_tokens == a.usage.prompt_tokens


def test_streaming_chat_shape(mesh: Any, embeds_of: Any) -> None:
    import orjson

    body = {"model": MODEL, "temperature": 0, "max_completion_tokens": 8, "n": 2, "stream": True, "seed": 5,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [embeds_part(embeds_of, QUESTION)]}]}
    with httpx.stream("POST", f"{mesh.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first_delta: dict[int, dict[str, Any]] = {}
    text: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            first_delta.setdefault(ch["index"], ch["delta"])
            text[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"]:
                finishes[ch["index"]].append(ch["finish_reason"])
    assert first_delta[0].get("role") == "assistant" and first_delta[1].get("role") == "assistant"
    assert all(len(f) == 1 for f in finishes.values())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    whole = httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=60,
                       json={**body, "stream": False, "n": 1}).json()
    assert text[0] == whole["choices"][0]["message"]["content"]


def test_chat_stop_and_seed(client: Any) -> None:
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0.9, top_p=0.9, seed=11)
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0.9, top_p=0.9, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content
    full = chat(client, msgs, max_tokens=12).choices[0].message.content
    stop = full.split()[1] if len(full.split()) > 1 else full[:2]
    cut = chat(client, msgs, max_tokens=12, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content


def _torch() -> Any:
    import torch

    return torch


CHAT_CASES = [
    ("prompt_embeds part without data", lambda e: [{"role": "user", "content": [{"type": "prompt_embeds"}]}],
     "messages[0].content[0].data"),
    ("bad base64", lambda e: [{"role": "user", "content": [{"type": "prompt_embeds", "data": "%%%"}]}],
     "messages[0].content[0].data"),
    ("wrong hidden size", lambda e: [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": b64_of(_torch().randn(3, 7))}]}], "messages[0].content[0]"),
    ("NaN rows", lambda e: [{"role": "user", "content": [
        {"type": "prompt_embeds", "data": b64_of(_torch().full((3, HIDDEN), float("nan")))}]}],
     "messages[0].content[0]"),
    ("placeholder typed in text", lambda e: [{"role": "user", "content": "fill <|prompt_embeds|> please"}],
     "messages[0].content"),
    ("unknown part type", lambda e: [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[0].type"),
    ("empty conversation", lambda e: [], "messages"),
    ("unknown role", lambda e: [{"role": "wizard", "content": "hi"}], "messages[0].role"),
]


@pytest.mark.parametrize("name,messages,param", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_input_is_a_400_naming_the_part(mesh: Any, embeds_of: Any, name: str, messages: Any,
                                                 param: str) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages(embeds_of), "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert ok.status_code == 200

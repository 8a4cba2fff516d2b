"""/v1/chat/completions shares the completions path (translation checked in the e2e tests); here: its shapes."""

from __future__ import annotations

import base64
from typing import Any

from tests.unit.gateway.conftest import MODEL, Harness


def test_chat_with_embeds_part_and_shapes(client: Any, gw: Harness) -> None:
    data = base64.b64encode(b"tensor bytes").decode()
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Describe:"}, {"type": "prompt_embeds", "data": data}]}], max_tokens=3)
    p = gw.fake.last("Chat").params
    parts = p.messages[0].parts
    assert p.messages[0].role == "user" and parts[0].text == "Describe:"
    assert parts[1].prompt_embeds.encoded.data == b"tensor bytes"
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == "Hello there"


def test_chat_stream(client: Any, gw: Harness) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = {0: "", 1: ""}
    roles: dict[int, int] = {0: 0, 1: 0}
    finishes: list[tuple[int, str]] = []
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            roles[ch.index] += ch.delta.role == "assistant"
            if ch.finish_reason:
                finishes.append((ch.index, ch.finish_reason))
    assert text == {0: "Hello", 1: "World"} and roles == {0: 1, 1: 1}
    assert sorted(finishes) == [(0, "stop"), (1, "length")]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7

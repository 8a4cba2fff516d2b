"""The completion body: prompts as (texts, token-id lists), an empty prompt beside prompt_embeds dropped."""

from __future__ import annotations

from embedmesh.gateway.requests import CompletionRequest, parse


def test_prompt_shapes() -> None:
    assert parse(CompletionRequest, {"model": "m", "prompt": "hi"}).prompt == (["hi"], [])
    assert parse(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]]}).prompt == ([], [[1, 2], [3]])


def test_an_empty_prompt_beside_prompt_embeds_is_dropped() -> None:
    req = parse(CompletionRequest, {"model": "m", "prompt": "", "prompt_embeds": "AAEC"})
    assert req.prompt == ([], []) and req.prompt_embeds == [b"\x00\x01\x02"]

"""The embeddings body: inputs as EmbedInput messages, any falsy encoding as "float"."""

from __future__ import annotations

from embedmesh.gateway.requests import EmbeddingsRequest, parse


def test_inputs_and_encoding() -> None:
    req = parse(EmbeddingsRequest, {"model": "m", "input": ["a", "b"], "encoding_format": None})
    assert [i.text for i in req.input] == ["a", "b"] and req.encoding_format == "float"
    assert list(parse(EmbeddingsRequest, {"model": "m", "input": [1, 2]}).input[0].token_ids.ids) == [1, 2]

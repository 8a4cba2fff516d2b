"""A request's ``model`` is held to MAX_MODEL_NAME characters on every generation and embedding route: a longer name
is a 400 naming ``model`` with code ``too_long`` (never looked up, echoed whole or sent on); 256 is accepted."""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import parse
from embedmesh.gateway.requests.chat import ChatRequest
from embedmesh.gateway.requests.completion import CompletionRequest
from embedmesh.gateway.requests.embedding import EmbeddingsRequest
from embedmesh.gateway.requests.fields import MAX_MODEL_NAME

BODIES: list[tuple[Any, dict[str, Any]]] = [
    (CompletionRequest, {"prompt": "hi"}),
    (ChatRequest, {"messages": [{"role": "user", "content": "hi"}]}),
    (EmbeddingsRequest, {"input": "hi"}),
]


@pytest.mark.parametrize(("model", "body"), BODIES, ids=lambda x: getattr(x, "__name__", ""))
def test_a_20000_character_model_name_is_a_400_naming_model(model: Any, body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as e:
        parse(model, {"model": "m" * 20000, **body})
    assert (e.value.status, e.value.param, e.value.code) == (400, "model", "too_long")
    assert "256" in e.value.message and "20000" in e.value.message and len(e.value.message) < 200


@pytest.mark.parametrize(("model", "body"), BODIES, ids=lambda x: getattr(x, "__name__", ""))
def test_a_name_at_the_bound_is_accepted_and_an_empty_one_still_missing(model: Any, body: dict[str, Any]) -> None:
    assert MAX_MODEL_NAME == 256
    assert parse(model, {"model": "m" * 256, **body}).model == "m" * 256
    with pytest.raises(ApiError) as e:
        parse(model, {"model": "", **body})
    assert (e.value.param, e.value.code) == ("model", "missing")

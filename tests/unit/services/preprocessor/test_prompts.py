"""A completion's prompts (``preprocessor/prompts.py``): embeddings prompts first, then token ids, then text; each
refusal naming ``prompt`` / ``prompt[i]`` / ``prompt_embeds[i]`` with its reason; a prefix put before every prompt
and checked with it; and the model's tokenizer."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.models.convert import resolve_model_path
from embedmesh.services.preprocessor.prompt_embeds import RawEmbeds
from embedmesh.services.preprocessor.prompts import Prompt, Tokenizer, build_prompts, check_prompt
from embedmesh.tensor.v1 import tensor_pb2

SPEC = ModelSpec(hidden_size=2, max_context_tokens=16, dtype=tensor_pb2.DATA_TYPE_FP32)


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(ord(c) - 96 for c in text if c != " ")


def _rows(n: int, value: float = 0.0) -> np.ndarray:
    return np.full((n, 2), value, np.float32)


async def _resolve(raw: RawEmbeds, field: str) -> np.ndarray:
    assert raw.array is not None
    return raw.array


class _Resolver:
    """``resolve`` as ``build_prompts`` calls an ``EmbedsResolver``: whole rows, or rows with their arrival mark
    (none here: every row is there)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def __call__(self, raw: RawEmbeds, field: str) -> np.ndarray:
        return await self.fn(raw, field)  # type: ignore[no-any-return]

    async def rows(self, raw: RawEmbeds, field: str) -> tuple[np.ndarray, None]:
        return await self.fn(raw, field), None


def _build(*, texts: list[str] = (), ids: list[list[int]] = (), embeds: list[np.ndarray] = (),  # type: ignore[assignment]
           max_tokens: int = 2, max_prompts: int = 8, prefix: np.ndarray | None = None,
           resolve: Any = _resolve) -> list[Prompt]:
    return asyncio.run(build_prompts(
        texts=list(texts), token_prompts=list(ids), embeds=[RawEmbeds(array=e) for e in embeds], spec=SPEC,
        vocab_size=30, max_tokens=max_tokens, resolve=_Resolver(resolve), tokenizer=_Tok(), max_prompts=max_prompts,  # type: ignore[arg-type]
        prefix=None if prefix is None else RawEmbeds(array=prefix)))


def test_prompt_length_counts_ids_and_rows() -> None:
    assert len(Prompt(((1, 2), _rows(3), (4,)))) == 6
    assert Prompt.of_ids((1, 2)).pieces == ((1, 2),) and len(Prompt.of_embeds(_rows(4))) == 4


def test_embeddings_then_ids_then_text() -> None:
    out = _build(texts=["ab"], ids=[[7], [8, 9]], embeds=[_rows(1, 0.5)])
    assert len(out) == 4
    assert np.array_equal(out[0].pieces[0], _rows(1, 0.5))  # type: ignore[arg-type]
    assert [p.pieces for p in out[1:]] == [((7,),), ((8, 9),), ((1, 2),)]


def test_empty_text_beside_other_prompts_is_dropped() -> None:
    # vLLM's own example sends prompt="" beside prompt_embeds.
    assert [len(p) for p in _build(texts=[""], embeds=[_rows(2)])] == [2]
    assert [p.pieces for p in _build(texts=["", "a"], ids=[[3]])] == [((3,),), ((1,),)]


@pytest.mark.parametrize(("kw", "field", "reason", "message"), [
    ({}, "prompt", "MISSING_PROMPT", "either prompt or prompt_embeds is required"),
    ({"texts": ["a", "b", "c"], "max_prompts": 2}, "prompt", "TOO_MANY_PROMPTS",
     "at most 2 prompts per request, got 3"),
    ({"texts": [""]}, "prompt", "EMPTY_PROMPT", "prompt: empty text prompt"),
    ({"texts": ["a", ""]}, "prompt[1]", "EMPTY_PROMPT", "prompt[1]: empty text prompt"),
    ({"texts": [" "]}, "prompt", "EMPTY_PROMPT", "prompt: the prompt tokenizes to nothing"),
    ({"ids": [[]]}, "prompt", "EMPTY_PROMPT", "prompt: token id list is empty"),
    ({"ids": [[1], [2, 30]]}, "prompt[1]", "TOKEN_OUT_OF_RANGE",
     "prompt[1]: token id 30 is outside the vocabulary [0, 30)"),
    ({"ids": [[-1]]}, "prompt", "TOKEN_OUT_OF_RANGE", "prompt: token id -1 is outside the vocabulary [0, 30)"),
    ({"ids": [list(range(15))]}, "prompt", "CONTEXT_OVERFLOW",
     "prompt: 15 prompt tokens + max_tokens 2 exceed the model's context of 16"),
    ({"texts": ["a", "abcdefghijklmno"]}, "prompt[1]", "CONTEXT_OVERFLOW",
     "prompt[1]: 15 prompt tokens + max_tokens 2 exceed the model's context of 16"),
    ({"ids": [[1] * 10], "prefix": _rows(5)}, "prompt_embeds_prefix", "CONTEXT_OVERFLOW",
     "prompt_embeds_prefix: 15 prompt tokens + max_tokens 2 exceed the model's context of 16"),
])
def test_refusals_name_the_prompt(kw: dict[str, Any], field: str, reason: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        _build(**kw)
    assert (e.value.field, e.value.reason, e.value.message) == (field, reason, message)


def test_embeddings_are_resolved_under_their_client_names() -> None:
    seen: list[str] = []

    async def resolve(raw: RawEmbeds, field: str) -> np.ndarray:
        seen.append(field)
        return await _resolve(raw, field)

    _build(embeds=[_rows(1)], resolve=resolve)
    _build(embeds=[_rows(1), _rows(2)], prefix=_rows(1), resolve=resolve)
    assert seen == ["prompt_embeds", "prompt_embeds[0]", "prompt_embeds[1]", "prompt_embeds_prefix"]


def test_the_prefix_goes_before_every_prompt() -> None:
    out = _build(ids=[[3]], texts=["b"], prefix=_rows(2, 1.0))
    for p, rest in zip(out, [(3,), (2,)], strict=True):
        assert len(p.pieces) == 2 and np.array_equal(p.pieces[0], _rows(2, 1.0)) and p.pieces[1] == rest  # type: ignore[arg-type]


def test_check_prompt_accepts_a_prompt_that_exactly_fits() -> None:
    p = Prompt.of_ids(tuple(range(14)))
    assert check_prompt(p, SPEC, "prompt", 2) is p


def test_the_models_tokenizer_round_trips_text() -> None:
    tok = Tokenizer(resolve_model_path("default"))
    ids = tok.encode("Hello, world!")
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "Hello, world!" and tok.decode(list(ids)) == "Hello, world!"

"""The input rules the embedding engines share (``engines/embed_inputs.py``): pooling read from a
sentence-transformers folder, the ``dimensions`` rule with its messages, Matryoshka truncation, and text or token
ids checked into token ids naming ``input`` / ``input[i]``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.worker.engines.base import ModelInfo
from embedmesh.services.worker.engines.embed_inputs import (
    InputEncoder,
    PoolingSpec,
    check_dimensions,
    input_field,
    read_pooling_spec,
    shorten,
)


def _folder(tmp: Path, *, pooling: dict[str, Any] | None = None, modules: list[dict[str, Any]] | None = None,
            st: dict[str, Any] | None = None, pooling_dir: str = "1_Pooling") -> Path:
    if pooling is not None:
        (tmp / pooling_dir).mkdir(parents=True)
        (tmp / pooling_dir / "config.json").write_text(json.dumps(pooling))
    if modules is not None:
        (tmp / "modules.json").write_text(json.dumps(modules))
    if st is not None:
        (tmp / "sentence_bert_config.json").write_text(json.dumps(st))
    return tmp


def test_a_bare_folder_means_mean_pooling_unnormalised_at_the_model_length(tmp_path: Path) -> None:
    assert read_pooling_spec(tmp_path, 512) == PoolingSpec("mean", False, 512)


def test_a_sentence_transformers_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path, pooling={"pooling_mode_mean_tokens": True},
                     modules=[{"type": "sentence_transformers.models.Transformer", "path": ""},
                              {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                              {"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"}],
                     st={"max_seq_length": 256})
    assert read_pooling_spec(folder, 512) == PoolingSpec("mean", True, 256)


def test_cls_pooling_from_the_folder_modules_json_names(tmp_path: Path) -> None:
    folder = _folder(tmp_path, pooling={"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                     modules=[{"type": "sentence_transformers.models.Pooling", "path": "pool"}], pooling_dir="pool",
                     st={"max_seq_length": 4096})
    # max_seq_length beyond the model's positions is capped to them.
    assert read_pooling_spec(folder, 512) == PoolingSpec("cls", False, 512)


def test_other_pooling_modes_are_refused_naming_them(tmp_path: Path) -> None:
    folder = _folder(tmp_path, pooling={"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False,
                                        "pooling_mode_lasttoken": True})
    with pytest.raises(ValueError) as e:
        read_pooling_spec(folder, 512)
    assert str(e.value) == (f"{folder}: pooling ['pooling_mode_lasttoken', 'pooling_mode_max_tokens'] is not "
                            "supported (mean or cls only)")


def test_input_field_names() -> None:
    assert input_field(0, 1) == "input" and input_field(0, 2) == "input[0]" and input_field(3, 5) == "input[3]"


INFO = ModelInfo("emb", "hf-embed", 384, 256, "float32", 1000, 8, task="embed", embedding_size=8)


def test_dimensions_unset_or_full_size_are_accepted_everywhere() -> None:
    check_dimensions(None, INFO)
    check_dimensions(8, INFO)


@pytest.mark.parametrize("dimensions", [0, 9, -1])
def test_dimensions_out_of_range(dimensions: int) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_dimensions(dimensions, INFO)
    assert (e.value.field, e.value.reason) == ("dimensions", "OUT_OF_RANGE")
    assert e.value.message == f"dimensions: must be between 1 and 8 for emb, got {dimensions}"


def test_dimensions_need_a_matryoshka_model() -> None:
    with pytest.raises(InvalidArgument) as e:
        check_dimensions(4, INFO)
    assert (e.value.field, e.value.reason) == ("dimensions", "DIMENSIONS_UNSUPPORTED")
    assert e.value.message == ("dimensions: emb was not trained for shortened vectors (not Matryoshka); omit "
                               "dimensions or pass 8")
    from dataclasses import replace

    check_dimensions(4, replace(INFO, supports_dimensions=True))


def test_shorten_keeps_the_first_components_renormalised() -> None:
    v = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 1.0]], np.float64)
    out = shorten(v, 2)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    assert np.allclose(out, [[0.6, 0.8], [0.0, 0.0]])  # an all-zero cut stays zero (no division by zero)
    same = shorten(v, None)
    assert same.dtype == np.float32 and np.array_equal(same, v.astype(np.float32))
    assert np.array_equal(shorten(v, 3), v.astype(np.float32))


class _Tok:
    def __call__(self, text: str, *, add_special_tokens: bool) -> dict[str, list[int]]:
        assert add_special_tokens
        return {"input_ids": [101, *(ord(c) for c in text), 102]}


ENC = InputEncoder(_Tok(), "emb", vocab_size=200, max_tokens=5)


def test_text_and_ids_become_token_ids() -> None:
    assert ENC.encode(["ab", [1, 2, 199]]) == [[101, 97, 98, 102], [1, 2, 199]]
    assert ENC.encode_one((7,), "input") == [7]


@pytest.mark.parametrize(("inputs", "field", "reason", "message"), [
    ([""], "input", "EMPTY_INPUT", "input: empty string"),
    (["a", []], "input[1]", "EMPTY_INPUT", "input[1]: empty token list"),
    ([[1, 200]], "input", "TOKEN_OUT_OF_RANGE", "input: token id 200 is outside the vocabulary [0, 200)"),
    ([[5], [-1]], "input[1]", "TOKEN_OUT_OF_RANGE", "input[1]: token id -1 is outside the vocabulary [0, 200)"),
    (["abcd"], "input", "INPUT_TOO_LONG",
     "input: 6 tokens; emb accepts at most 5 per input (inputs are never truncated)"),
    ([[1, 2, 3, 4, 5, 6]], "input", "INPUT_TOO_LONG",
     "input: 6 tokens; emb accepts at most 5 per input (inputs are never truncated)"),
])
def test_bad_inputs_name_the_input(inputs: list[Any], field: str, reason: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        ENC.encode(inputs)
    assert (e.value.field, e.value.reason, e.value.message) == (field, reason, message)


def test_the_longest_input_is_accepted() -> None:
    assert ENC.encode(["abc"]) == [[101, 97, 98, 99, 102]] and len(ENC.encode([[1] * 5])[0]) == 5

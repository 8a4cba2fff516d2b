"""Input rules shared by the embedding engines (``hf_embed``, ``sglang``): pooling read from a sentence-transformers
folder, text or token ids -> checked token ids naming ``input[i]``, the ``dimensions`` rule and Matryoshka
truncation. One place, so errors and token counts match whichever engine serves ``/v1/embeddings``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from embedmesh.core import model_rules
from embedmesh.core.errors import InvalidArgument
from embedmesh.services.worker.engines.base import ModelInfo

__all__ = ["PoolingSpec", "InputEncoder", "read_pooling_spec", "check_dimensions", "shorten", "input_field"]


@dataclass(frozen=True)
class PoolingSpec:
    """How a sentence-transformers folder turns token states into one vector."""

    pooling: str
    """"mean" (over the attention mask) or "cls"."""
    normalize: bool
    """L2-normalise the pooled vector (a ``Normalize`` module in modules.json)."""
    max_tokens: int
    """Longest input, special tokens included (``max_seq_length``)."""


def read_pooling_spec(folder: Path, max_position_embeddings: int) -> PoolingSpec:
    """Read pooling, normalisation and length from the folder, as sentence-transformers would."""
    pooling_cfg = folder / "1_Pooling" / "config.json"
    modules_cfg = folder / "modules.json"
    st_cfg = folder / "sentence_bert_config.json"
    modules = json.loads(modules_cfg.read_text()) if modules_cfg.exists() else []
    for m in modules:
        if m.get("type", "").endswith("Pooling") and m.get("path"):
            pooling_cfg = folder / m["path"] / "config.json"
    pooling = json.loads(pooling_cfg.read_text()) if pooling_cfg.exists() else {"pooling_mode_mean_tokens": True}
    if pooling.get("pooling_mode_cls_token"):
        mode = "cls"
    elif pooling.get("pooling_mode_mean_tokens", False):
        mode = "mean"
    else:
        unsupported = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
        raise ValueError(f"{folder}: pooling {unsupported} is not supported (mean or cls only)")
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    max_tokens = max_position_embeddings
    if st_cfg.exists():
        max_tokens = int(json.loads(st_cfg.read_text()).get("max_seq_length") or max_tokens)
    return PoolingSpec(mode, normalize, min(max_tokens, max_position_embeddings))


def input_field(i: int, n: int) -> str:
    """The name a client knows input i by: ``input`` for a single input, ``input[i]`` in a list."""
    return "input" if n == 1 else f"input[{i}]"


def check_dimensions(dimensions: int | None, info: ModelInfo) -> None:
    """Raise the 400 for a ``dimensions`` the model cannot honour (the rule of ``core/model_rules.py``)."""
    model_rules.check_dimensions(dimensions, info.model, info.embedding_size, info.supports_dimensions)


def shorten(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Keep the first ``dimensions`` components and re-normalise (Matryoshka truncation)."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return np.ascontiguousarray(vectors, dtype=np.float32)
    cut = vectors[:, :dimensions]
    cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(cut, dtype=np.float32)


class _Tokenizer(Protocol):
    def __call__(self, text: str, *, add_special_tokens: bool) -> Any: ...


@dataclass(frozen=True)
class InputEncoder:
    """Text or token ids -> checked token ids (special tokens included), errors naming ``input[i]``."""

    tokenizer: _Tokenizer
    model: str
    vocab_size: int
    max_tokens: int

    def encode_one(self, item: str | Sequence[int], field: str) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise InvalidArgument(f"{field}: empty string", field=field, reason="EMPTY_INPUT")
            ids = list(self.tokenizer(item, add_special_tokens=True)["input_ids"])
        else:
            if len(item) == 0:
                raise InvalidArgument(f"{field}: empty token list", field=field, reason="EMPTY_INPUT")
            bad = next((t for t in item if t < 0 or t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                      field=field, reason="TOKEN_OUT_OF_RANGE")
            ids = [int(t) for t in item]
        if len(ids) > self.max_tokens:
            raise InvalidArgument(f"{field}: {len(ids)} tokens; {self.model} accepts at most {self.max_tokens} per "
                                  "input (inputs are never truncated)", field=field, reason="INPUT_TOO_LONG")
        return ids

    def encode(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        return [self.encode_one(item, input_field(i, len(inputs))) for i, item in enumerate(inputs)]

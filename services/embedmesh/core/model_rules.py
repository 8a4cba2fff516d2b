"""Request rules that depend on the model serving the request, written once for every process that checks them
(the preprocessor before it routes, the worker and its engines whoever called): ``logit_bias`` token ids within
the vocabulary, and ``dimensions`` an embedding model can honour."""

from __future__ import annotations

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams

__all__ = ["check_sampling_for_model", "check_dimensions"]


def check_sampling_for_model(sampling: SamplingParams, vocab_size: int) -> None:
    """Sampling rules that depend on the model: logit_bias keys are token ids of its vocabulary."""
    bad = next((t for t, _ in sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})",
                              field="logit_bias", reason="TOKEN_OUT_OF_RANGE")


def check_dimensions(dimensions: int | None, model: str, embedding_size: int, supports_dimensions: bool
                     ) -> int | None:
    """``dimensions`` checked against the embedding model ``model``: None when unset or the model's full size (the
    vectors are not shortened), else the number of components to keep (Matryoshka models only)."""
    if dimensions is None or dimensions == embedding_size:
        return None
    if not 1 <= dimensions <= embedding_size:
        raise InvalidArgument(f"dimensions: must be between 1 and {embedding_size} for {model}, got "
                              f"{dimensions}", field="dimensions", reason="OUT_OF_RANGE")
    if not supports_dimensions:
        raise InvalidArgument(f"dimensions: {model} was not trained for shortened vectors (not Matryoshka); "
                              f"omit dimensions or pass {embedding_size}", field="dimensions",
                              reason="DIMENSIONS_UNSUPPORTED")
    return dimensions

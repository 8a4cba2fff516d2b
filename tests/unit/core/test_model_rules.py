"""The model-dependent rules every process applies: logit_bias ids within the vocabulary, ``dimensions`` within the
embedding size and shorter only for Matryoshka models (the full size counts as unset)."""

from __future__ import annotations

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.model_rules import check_dimensions, check_sampling_for_model
from embedmesh.core.sampling import SamplingParams


def test_logit_bias_ids_are_in_the_vocabulary() -> None:
    check_sampling_for_model(SamplingParams(logit_bias=((9, 1.0),)), 10)
    with pytest.raises(InvalidArgument) as e:
        check_sampling_for_model(SamplingParams(logit_bias=((10, 1.0),)), 10)
    assert (e.value.field, e.value.reason) == ("logit_bias", "TOKEN_OUT_OF_RANGE")


def test_dimensions() -> None:
    assert check_dimensions(None, "m", 8, False) is None and check_dimensions(8, "m", 8, False) is None
    assert check_dimensions(4, "m", 8, True) == 4
    for bad, reason in ((0, "OUT_OF_RANGE"), (9, "OUT_OF_RANGE"), (4, "DIMENSIONS_UNSUPPORTED")):
        with pytest.raises(InvalidArgument) as e:
            check_dimensions(bad, "m", 8, False)
        assert (e.value.field, e.value.reason) == ("dimensions", reason)

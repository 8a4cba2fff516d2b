"""``sampling_from_proto`` takes the whole int64 seed range (as OpenAI's API does), and ``choice_seed`` gives the n
choices of a request distinct seeds that stay in int64 — ``seed = INT64_MAX`` with ``n > 1`` used to overflow the
proto field (a 500)."""

from __future__ import annotations

import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.sampling import SEED_MAX, SEED_MIN, choice_seed, sampling_from_proto


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 1, SEED_MAX])
def test_every_int64_seed_is_accepted(seed: int) -> None:
    assert sampling_from_proto(common_pb2.SamplingParams(seed=seed)).seed == seed


@pytest.mark.parametrize("seed", [SEED_MAX, SEED_MAX - 1, SEED_MIN, -1, 0, 12345])
def test_choice_seeds_are_distinct_int64s_that_fit_the_proto(seed: int) -> None:
    seeds = [choice_seed(seed, i) for i in range(8)]
    assert seeds[0] == seed
    assert len(set(seeds)) == 8
    for s in seeds:
        assert SEED_MIN <= s <= SEED_MAX
        assert common_pb2.SamplingParams(seed=s).seed == s  # would raise ValueError out of range
    assert seeds == [choice_seed(seed, i) for i in range(8)]  # a repeated request gets the same seeds


def test_choice_seed_is_seed_plus_index_until_it_wraps() -> None:
    assert choice_seed(100, 3) == 103
    assert choice_seed(SEED_MAX, 1) == SEED_MIN
    assert choice_seed(SEED_MAX, 2) == SEED_MIN + 1

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


# --- the OpenAI-surface fields: one range rule for the preprocessor and every worker --------------------------
from embedmesh.core.errors import InvalidArgument  # noqa: E402
from embedmesh.core.sampling import Structured, sampling_to_proto  # noqa: E402


@pytest.mark.parametrize(("fields", "field", "needle"), [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2.0, 2.0]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "[-2.0, 2.0]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "[-2.0, 2.0]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "(0.0, 2.0]"),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
])
def test_out_of_range_values_are_refused_naming_the_field(fields: dict[str, object], field: str,
                                                          needle: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        sampling_from_proto(common_pb2.SamplingParams(**fields))
    assert e.value.field == field and needle in str(e.value)


def test_logit_bias_values_and_ids_are_checked() -> None:
    p = common_pb2.SamplingParams()
    p.logit_bias[5] = 100.5
    with pytest.raises(InvalidArgument, match="bias of token 5 must be in") as e:
        sampling_from_proto(p)
    assert e.value.field == "logit_bias"
    p = common_pb2.SamplingParams()
    p.logit_bias[-1] = 1.0
    with pytest.raises(InvalidArgument, match="negative"):
        sampling_from_proto(p)


def test_max_tokens_zero_only_scores_the_prompt() -> None:
    s = sampling_from_proto(common_pb2.SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert s.max_tokens == 0 and s.prompt_logprobs == 0


def test_empty_structured_constraints_are_refused() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()).structured is None
    p = common_pb2.SamplingParams()
    p.structured.regex = ""  # set (a oneof member has presence) but empty
    with pytest.raises(InvalidArgument) as e:
        sampling_from_proto(p)
    assert e.value.field == "structured_outputs.regex"
    p.structured.choice.SetInParent()
    with pytest.raises(InvalidArgument) as e:
        sampling_from_proto(p)
    assert e.value.field == "structured_outputs.choice"


def test_to_proto_and_back_keeps_every_field() -> None:
    p = common_pb2.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=-4, stop=["x"],
                                  ignore_eos=True, presence_penalty=0.5, frequency_penalty=-1.0,
                                  repetition_penalty=1.3, logprobs=4, prompt_logprobs=2, min_tokens=2)
    p.logit_bias[9] = -100.0
    p.logit_bias[3] = 5.0
    p.structured.choice.values.extend(["yes", "no"])
    s = sampling_from_proto(p)
    assert s.logit_bias == ((3, 5.0), (9, -100.0))
    assert s.structured == Structured("choice", ("yes", "no"))
    assert sampling_from_proto(sampling_to_proto(s)) == s

"""The mocker's options: impossible values are refused naming the setting (the worker exits 2)."""

from __future__ import annotations

import math

import pytest

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.mocker.config import MockerOptions, check_capacity


@pytest.mark.parametrize(("field", "value"), [
    ("mocker_num_blocks", 0), ("mocker_max_context_tokens", 0), ("mocker_hidden_size", 0),
    ("mocker_vocab_size", 1), ("mocker_prefill_ms_per_token", -1.0), ("mocker_decode_ms", math.nan),
    ("mocker_decode_ms_per_seq", math.inf), ("mocker_speedup", 0.0), ("max_batch_size", 0),
])
def test_impossible_values_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        MockerOptions(**{field: value})


def test_the_cache_must_hold_one_longest_request() -> None:
    check_capacity(MockerOptions(mocker_num_blocks=64, mocker_max_context_tokens=1024), 16)
    with pytest.raises(ValueError, match="at least 64 blocks"):
        check_capacity(MockerOptions(mocker_num_blocks=63, mocker_max_context_tokens=1024), 16)


def test_a_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        WorkerConfig.from_args(["--engine", "mocker", "--mocker-speedup", "-2"], env={})
    assert e.value.code == 2
    assert "mocker_speedup must be a finite number > 0" in capsys.readouterr().err


def test_flags_and_variables_reach_the_options() -> None:
    c = WorkerConfig.from_args(["--engine", "mocker", "--mocker-num-blocks", "100"],
                               env={"EMBEDMESH_WORKER_MOCKER_SEED": "7"})
    o = c.options_as(MockerOptions)
    assert (o.mocker_num_blocks, o.mocker_seed) == (100, 7)

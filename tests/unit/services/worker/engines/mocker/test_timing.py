"""The mocker's timing model."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.engines.mocker.timing import Timing


def test_prefill_is_proportional_to_uncached_tokens_and_divided_by_the_speedup() -> None:
    t = Timing(prefill_ms_per_token=0.5, speedup=2.0)
    assert t.prefill_seconds(0) == 0
    assert t.prefill_seconds(400) == pytest.approx(0.1)
    assert t.prefill_seconds(800) == pytest.approx(2 * t.prefill_seconds(400))


def test_a_decode_step_grows_with_the_batch() -> None:
    t = Timing(decode_ms=4.0, decode_ms_per_seq=1.0)
    assert t.decode_seconds(0) == 0
    assert t.decode_seconds(1) == pytest.approx(0.005)
    assert t.decode_seconds(8) == pytest.approx(0.012)
    assert t.step_seconds(100, 8) == pytest.approx(t.prefill_seconds(100) + t.decode_seconds(8))

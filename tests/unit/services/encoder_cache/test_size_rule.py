"""SizeRule: per size class, the L2 is used until measured, then only while an L2 hit beats lookup + compute."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from embedmesh.services.encoder_cache.size_rule import SizeRule, size_class

MIB = 1 << 20


def test_size_classes_are_powers_of_two() -> None:
    assert size_class(0) == 0
    assert size_class(1) == 1
    assert size_class(MIB - 1) == 20
    assert size_class(MIB) == size_class(2 * MIB - 1) == 21
    assert size_class(2 * MIB) == 22


def test_l2_used_until_both_sides_are_measured() -> None:
    rule = SizeRule(min_samples=3)
    for _ in range(2):
        rule.record_l2(MIB, 1.0)
        rule.record_compute(MIB, 0.001)
    assert rule.use_l2(MIB), "two samples are not enough to decide"
    rule.record_l2(MIB, 1.0)
    assert rule.use_l2(MIB), "no third computation yet"
    rule.record_compute(MIB, 0.001)
    assert not rule.use_l2(MIB)
    assert rule.decided() == {size_class(MIB): False}


def test_decision_is_per_size_class_and_per_byte() -> None:
    rule = SizeRule(min_samples=1)
    rule.record_l2(MIB, 0.010)  # 1 MiB read in 10 ms
    rule.record_compute(int(1.5 * MIB), 0.012)  # same class: 1.5 MiB computed in 12 ms: 8 ms per MiB, faster
    assert not rule.use_l2(MIB) and not rule.use_l2(2 * MIB - 1)
    assert rule.use_l2(4 * MIB) and rule.use_l2(1000), "other classes are not measured: L2 used"
    rule.record_l2(4 * MIB, 0.001)
    rule.record_compute(4 * MIB, 0.010)
    assert rule.use_l2(4 * MIB)


def test_the_lookup_paid_before_computing_counts_against_computing() -> None:
    """Every L1 miss pays one L2 round trip (the header gives the size): a hit only has to beat it plus compute."""
    rule = SizeRule(min_samples=1)
    rule.record_l2(50_000, 0.00015)
    rule.record_compute(50_000, 0.0001)
    assert not rule.use_l2(50_000), "a hit slower than computing alone"
    rule.record_lookup(50_000, 0.0001)
    assert rule.use_l2(50_000), "but faster than the lookup that found nothing plus computing"


def test_median_not_one_outlier() -> None:
    rule = SizeRule(min_samples=3)
    for s in (0.001, 0.001, 0.5):  # one stalled L2 read
        rule.record_l2(MIB, s)
    for _ in range(3):
        rule.record_compute(MIB, 0.004)
    assert rule.use_l2(MIB)


def test_l2_comes_back_when_computing_gets_slower() -> None:
    rule = SizeRule(min_samples=2, window=2, relearn_seconds=float("inf"))
    for _ in range(2):
        rule.record_l2(MIB, 0.010)
        rule.record_compute(MIB, 0.005)
    assert not rule.use_l2(MIB)
    for _ in range(2):  # no more L2 samples while skipped, but computations keep being timed
        rule.record_compute(MIB, 0.050)
    assert rule.use_l2(MIB)


def test_a_skip_is_measured_again_after_relearn_seconds() -> None:
    now = [0.0]
    rule = SizeRule(min_samples=2, window=4, relearn_seconds=600, clock=lambda: now[0])
    for _ in range(2):
        rule.record_l2(MIB, 0.010)
        rule.record_compute(MIB, 0.001)
    assert not rule.use_l2(MIB)
    now[0] = 599.0
    assert not rule.use_l2(MIB)
    now[0] = 600.0
    assert rule.use_l2(MIB) and rule.decided() == {}, "forgotten: measured again from scratch"
    rule.record_l2(MIB, 0.001)
    rule.record_compute(MIB, 0.010)
    assert rule.use_l2(MIB), "one new sample each is not enough to decide again"
    rule.record_l2(MIB, 0.001)
    rule.record_compute(MIB, 0.010)
    assert rule.use_l2(MIB) and rule.decided() == {size_class(MIB): True}, "conditions changed: the L2 wins now"
    now[0] = 10_000.0
    assert rule.use_l2(MIB), "a 'use' decision keeps being checked by every hit, it does not expire"


def test_each_decision_logged_once_at_debug(caplog: Any) -> None:
    caplog.set_level(logging.DEBUG, logger="embedmesh.services.encoder_cache.size_rule")
    rule = SizeRule(min_samples=1)
    for _ in range(5):
        rule.record_l2(MIB, 0.010)
        rule.record_compute(MIB, 0.001)
    decisions = [r for r in caplog.records if r.name.endswith("size_rule")]
    assert len(decisions) == 1 and decisions[0].levelno == logging.DEBUG
    assert "skipped" in decisions[0].getMessage() and "1 MiB..2 MiB" in decisions[0].getMessage()


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        SizeRule(min_samples=0)
    with pytest.raises(ValueError):
        SizeRule(min_samples=5, window=4)

"""The staged-read cost model corrected by completed reads (transfer.observed_costs): it converges to the observed
rate, stays bounded under any samples, flips a choice when the observed costs say so, and probes the path not
taken."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core.staging import INTO_BLOCKS, INTO_BUFFER, Choice
from kvbridge_agent.transfer.observed_costs import (
    CEILING,
    DIRECT,
    STAGED,
    STEP,
    WEIGHT,
    Correction,
    ObservedCosts,
)

MARGIN = 0.85
ratios = st.floats(min_value=1 / CEILING, max_value=CEILING)
estimates = st.floats(min_value=1e-6, max_value=10.0)
samples = st.floats(allow_nan=True, allow_infinity=True)  # negative, zero, NaN and infinite ones too


def choice(direct: float, staged: float) -> Choice:
    return Choice(staged < MARGIN * direct, INTO_BUFFER, direct, math.inf, staged)


def samples_to_within(ratio: float, tolerance: float) -> int:
    """Samples a correction from 1 needs to come within ``tolerance`` (a factor) of a steady ``ratio``: closing
    ``WEIGHT * log(STEP)`` per sample while beyond ``STEP``, then ``(1 - WEIGHT)`` of the rest per sample."""
    gap = abs(math.log(ratio))
    far = max(0.0, gap - math.log(STEP))
    near = min(gap, math.log(STEP))
    closing = math.ceil(far / (WEIGHT * math.log(STEP)))
    shrinking = (
        0 if near <= math.log(tolerance) else math.ceil(math.log(math.log(tolerance) / near) / math.log(1 - WEIGHT))
    )
    return closing + shrinking + 1


@settings(max_examples=200, deadline=None)
@given(ratio=ratios, estimate=estimates)
def test_the_correction_converges_to_a_steady_observed_rate(ratio: float, estimate: float) -> None:
    correction = Correction()
    for _ in range(samples_to_within(ratio, 1.05)):
        correction.observe(estimate, estimate * ratio)
    assert abs(math.log(correction.scale / ratio)) <= math.log(1.05)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(estimates, samples), min_size=1, max_size=200))
def test_the_correction_is_bounded_under_any_samples(pairs: list[tuple[float, float]]) -> None:
    correction = Correction()
    for estimated, observed in pairs:
        before = correction.log_scale
        correction.observe(estimated, observed)
        assert abs(correction.log_scale - before) <= WEIGHT * math.log(STEP) + 1e-12  # one sample: one small step
        assert 1 / CEILING - 1e-12 <= correction.scale <= CEILING + 1e-12


@given(st.floats(min_value=1e3, max_value=1e12))
def test_one_outlier_moves_the_correction_by_a_bounded_factor(outlier: float) -> None:
    correction = Correction()
    correction.observe(1e-3, 1e-3 * outlier)
    assert correction.scale <= STEP**WEIGHT + 1e-12


@settings(max_examples=100, deadline=None)
@given(direct=estimates, share=st.floats(min_value=0.2, max_value=0.6), truth=st.floats(min_value=1.3, max_value=3.0))
def test_the_choice_flips_when_staged_reads_prove_slower_than_estimated(
    direct: float, share: float, truth: float
) -> None:
    """The model says staged (``share`` of direct); staged reads in fact take ``truth`` times direct ones, and
    direct ones their estimate: the choice turns direct, and back to staged once staged reads are as fast as
    estimated."""
    slow = truth / share
    model = choice(direct, share * direct)
    costs = ObservedCosts(explore_every=0)
    assert costs.choose(model, MARGIN).staged
    for _ in range(samples_to_within(slow, 1.05)):
        costs.observe(STAGED, share * direct, slow * share * direct)
        costs.observe(DIRECT, direct, direct)
    assert not costs.choose(model, MARGIN).staged
    for _ in range(samples_to_within(slow, 1.05)):
        costs.observe(STAGED, share * direct, share * direct)
    assert costs.choose(model, MARGIN).staged


def test_one_outlier_does_not_flip_a_choice_with_room() -> None:
    model = choice(1.0, 0.5)
    costs = ObservedCosts(explore_every=0)
    costs.observe(STAGED, 0.5, 1e6)
    assert costs.choose(model, MARGIN).staged


def test_the_path_not_taken_is_probed_now_and_then_but_not_when_dear() -> None:
    costs = ObservedCosts(explore_every=8)
    taken = [costs.choose(choice(1.0, 2.0), MARGIN).staged for _ in range(40)]
    assert taken.count(True) == costs.explored == 4  # every ninth: the staged path's estimate stays fresh
    assert all(taken[i] == (i % 9 == 8) for i in range(40))
    dear = ObservedCosts(explore_every=8)
    assert not any(dear.choose(choice(1.0, 10.0), MARGIN).staged for _ in range(40))  # 10x dearer: never probed


def test_expected_names_the_path_and_the_uncorrected_estimate() -> None:
    costs = ObservedCosts()
    assert costs.expected() is None
    costs.direct.log_scale = math.log(3.0)
    costs.choose(Choice(True, INTO_BLOCKS, 2.0, 0.5, 0.7), MARGIN)
    assert costs.expected() == (DIRECT, 2.0)
    assert costs.expected(INTO_BLOCKS) == (STAGED, 0.5)
    assert costs.expected(INTO_BUFFER) == (STAGED, 0.7)


def test_samples_at_the_ends_of_the_float_range_are_taken_bounded() -> None:
    """A ratio that underflows or overflows (a subnormal observed time) still counts, one bounded step."""
    correction = Correction()
    correction.observe(2.0, 5e-324)
    assert correction.scale == pytest.approx(STEP**-WEIGHT)
    correction.observe(5e-324, 1e308)
    assert correction.samples == 2

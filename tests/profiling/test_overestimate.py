"""AFS §4.5 overestimate-first: the exact rule of :func:`estimate_curve` and the plan."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as hs
from shoal.profiling.overestimate import (
    allocatable_units,
    estimate_curve,
    is_overestimated,
    measurement_plan,
)


def test_no_measurement_is_linear_scaling() -> None:
    assert estimate_curve({}, 4) == (0.0, 1.0, 2.0, 3.0, 4.0)


def test_one_measurement_scales_linearly_both_ways() -> None:
    # Measured 3.0 it/s on 4 GPUs: 0.75 it/s per GPU everywhere else.
    assert estimate_curve({4: 3.0}, 6) == (0.0, 0.75, 1.5, 2.25, 3.0, 3.75, 4.5)


def test_beyond_the_share_scales_from_the_last_allocatable_unit() -> None:
    # §4.5: "assumes the linear scalability from the last allocatable unit".
    curve = estimate_curve({1: 10.0, 2: 18.0, 4: 30.0}, 8)
    assert curve[:5] == (0.0, 10.0, 18.0, 18.0 * 3 / 2, 30.0)
    assert curve[8] == pytest.approx(30.0 * 8 / 4)
    assert curve[6] == pytest.approx(30.0 * 6 / 4)


def test_gap_is_capped_by_a_measured_larger_count() -> None:
    # Linear from 1 would say T(3) = 3 > measured T(4) = 2.
    assert estimate_curve({1: 1.0, 4: 2.0}, 4) == (0.0, 1.0, 2.0, 2.0, 2.0)


def test_nonsense_measurements_are_ignored() -> None:
    curve = estimate_curve({0: 5.0, -1: 3.0, 2: math.nan, 3: -1.0, 4: math.inf, 1: 2.0}, 3)
    assert curve == (0.0, 2.0, 4.0, 6.0)


def test_negative_max_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_gpus"):
        estimate_curve({1: 1.0}, -1)


def test_measurement_above_max_gpus_still_anchors() -> None:
    assert estimate_curve({8: 4.0}, 2) == (0.0, 0.5, 1.0)


def test_overestimated_until_every_count_is_measured() -> None:
    assert is_overestimated({}, 2)
    assert is_overestimated({1: 1.0}, 2)
    assert not is_overestimated({1: 1.0, 2: 1.5}, 2)
    assert not is_overestimated({1: 1.0, 2: 1.5, 4: 2.0}, 4, units=(1, 2, 4))


def test_allocatable_units_follow_network_packing() -> None:
    assert allocatable_units(16, 4) == (1, 2, 4, 8, 12, 16)
    assert allocatable_units(6) == (1, 2, 4, 6)
    assert allocatable_units(0) == ()


def test_plan_measures_the_share_then_shrinks() -> None:
    units = allocatable_units(16, 4)
    assert measurement_plan({}, 8, units) == (8, 4, 2, 1)
    assert measurement_plan({8: 5.0, 4: 3.0}, 8, units) == (2, 1)
    assert measurement_plan({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, 8, units) == ()


measurements = hs.dictionaries(
    hs.integers(1, 16), hs.floats(0.01, 1000, allow_nan=False, allow_infinity=False), max_size=6
)


@given(measurements, hs.integers(1, 24))
def test_measured_values_kept_and_estimates_are_positive(measured: dict[int, float], max_gpus: int) -> None:
    curve = estimate_curve(measured, max_gpus)
    assert len(curve) == max_gpus + 1 and curve[0] == 0.0
    for k in range(1, max_gpus + 1):
        assert curve[k] > 0
        if k in measured:
            assert curve[k] == measured[k]


@given(measurements, hs.integers(1, 24))
def test_estimates_are_optimistic_for_concave_truth(measured: dict[int, float], max_gpus: int) -> None:
    """For a truth with non-increasing per-GPU throughput and non-decreasing throughput,
    measuring some counts and estimating the rest never underestimates a count above
    the smallest measured one."""
    truth = [0.0] + [10.0 * math.sqrt(k) for k in range(1, 25)]
    points = {k: truth[k] for k in measured}
    curve = estimate_curve(points, max_gpus)
    lowest = min(points, default=None)
    for k in range(1, max_gpus + 1):
        if lowest is not None and k > lowest:
            assert curve[k] >= truth[k] - 1e-9


def test_reference_shape_is_rescaled_to_the_measurements() -> None:
    from shoal.profiling.overestimate import calibrate_reference

    reference = (0.0, 10.0, 18.0, 24.0, 28.0)
    # Measured 20 % slower than the profile at 2 GPUs: every other count follows.
    assert calibrate_reference({2: 14.4}, reference, 4) == pytest.approx((0.0, 8.0, 14.4, 19.2, 22.4))
    # Anchors are the nearest measured count below; the reference repeats past its end.
    curve = calibrate_reference({1: 10.0, 4: 14.0}, reference, 6)
    assert curve[2:4] == pytest.approx((18.0, 24.0)) and curve[5] == pytest.approx(14.0)
    # No usable reference at an anchor: the plain overestimate.
    assert calibrate_reference({2: 4.0}, (0.0, 1.0, 0.0), 3) == estimate_curve({2: 4.0}, 3)

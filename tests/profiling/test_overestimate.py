"""AFS §4.5 overestimate-first: the exact rule of :func:`estimate_curve` and the plan."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as hs
from shoal.allocation import decide_shares
from shoal.policies.base import ClusterView, JobView
from shoal.profiling.overestimate import (
    allocatable_units,
    decide_overestimate_first,
    estimate_curve,
    fair_share,
    first_share_view,
    is_overestimated,
    measurement_plan,
    probe_shares,
)
from shoal.sim.engine import make_policy


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


# -- §4.5 in the allocation pipeline ---------------------------------------------------

SUBLINEAR = (0.0, *(float(k) if k <= 4 else 4.0 + 0.3 * (k - 4) for k in range(1, 17)))


def _view_with_a_new_job() -> ClusterView:
    """Seven measured sublinear jobs and one new job (linear estimate) on 64 GPUs."""
    old = [
        JobView(job_id=f"a{i}", arrival_s=float(i), max_gpus=16, requested_gpus=16, throughput=SUBLINEAR)
        for i in range(7)
    ]
    new = JobView(
        job_id="new", arrival_s=100.0, max_gpus=16, requested_gpus=16, throughput=estimate_curve({}, 16)
    )
    return ClusterView(now_s=100.0, total_gpus=64, jobs=(*old, new), gpus_per_node=4)


def test_fair_share_is_one_nth_of_the_cluster_rounded_down_never_zero() -> None:
    assert fair_share(64, 8) == 8
    assert fair_share(64, 6) == 10
    assert fair_share(4, 9) == 1
    assert fair_share(4, 0) == 4


def test_a_new_jobs_first_share_is_capped_at_one_nth() -> None:
    view = _view_with_a_new_job()
    # Without §4.5's cap AFS-P gives the linear-looking new job 16 of 64 GPUs (1/n = 8).
    uncapped = decide_shares(make_policy("afs-p"), view, {}, epoch=1)
    assert uncapped.shares["new"] > 8
    capped = decide_overestimate_first(
        make_policy("afs-p"), view, {}, estimates={"new": frozenset()}, epoch=1
    )
    assert capped.shares["new"] == 8
    # The GPUs the cap keeps from it go to the others by the policy's own rule.
    assert sum(capped.shares.values()) == 64


def test_a_measured_job_or_a_known_curve_is_not_capped() -> None:
    view = _view_with_a_new_job()
    assert first_share_view(view, {"new": frozenset({16})}) is view
    assert first_share_view(view, {}) is view


def test_cap_respects_min_gpus_and_leaves_rigid_jobs_alone() -> None:
    big = JobView(
        job_id="big", min_gpus=12, max_gpus=16, requested_gpus=16, throughput=estimate_curve({}, 16)
    )
    rigid = JobView(
        job_id="rigid", elastic=False, max_gpus=16, requested_gpus=16, throughput=estimate_curve({}, 16)
    )
    other = JobView(job_id="o", max_gpus=4, throughput=estimate_curve({}, 4))
    view = ClusterView(now_s=0.0, total_gpus=16, jobs=(big, rigid, other))  # fair share 5
    capped = {
        j.job_id: j for j in first_share_view(view, dict.fromkeys(("big", "rigid", "o"), frozenset())).jobs
    }
    assert capped["big"].max_gpus == 12
    assert capped["rigid"] == rigid
    assert capped["o"] == other


def test_probe_moves_a_measured_share_to_its_next_unit() -> None:
    job = JobView(job_id="j", max_gpus=16, requested_gpus=16, throughput=estimate_curve({}, 16))
    view = ClusterView(now_s=0.0, total_gpus=16, jobs=(job,), gpus_per_node=4)
    # Not measured at its share yet: it runs there first.
    assert probe_shares(view, {"j": 8}, {"j": frozenset()}) == {"j": 8}
    # Measured at 8: the largest unmeasured unit below, 4, then 2, then 1.
    assert probe_shares(view, {"j": 8}, {"j": frozenset({8})}) == {"j": 4}
    assert probe_shares(view, {"j": 8}, {"j": frozenset({8, 4})}) == {"j": 2}
    assert probe_shares(view, {"j": 8}, {"j": frozenset({8, 4, 2})}) == {"j": 1}
    # Whatever the policy decides meanwhile on the estimate (here: grow to 16), the units
    # below the given share are measured first; a smaller policy share wins.
    assert probe_shares(view, {"j": 16}, {"j": frozenset({8})}) == {"j": 4}
    assert probe_shares(view, {"j": 2}, {"j": frozenset({8})}) == {"j": 2}
    assert probe_shares(view, {}, {"j": frozenset({8})}) == {}
    # Every unit up to the share measured: the policy's share stands, and a larger one
    # is measured there first, then the units between (12 on 4-GPU servers).
    assert probe_shares(view, {"j": 8}, {"j": frozenset({8, 4, 2, 1})}) == {"j": 8}
    assert probe_shares(view, {"j": 16}, {"j": frozenset({8, 4, 2, 1})}) == {"j": 16}
    assert probe_shares(view, {"j": 16}, {"j": frozenset({16, 8, 4, 2, 1})}) == {"j": 12}
    # A known curve is never probed.
    assert probe_shares(view, {"j": 8}, {}) == {"j": 8}

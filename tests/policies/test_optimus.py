"""Optimus: NNLS, the all-reduce speed fit, marginal gain (eq. (9)), and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.models import AFS_TABLE4_MODELS, afs_catalog
from shoal.policies.base import ClusterView, JobView
from shoal.policies.optimus import Optimus, OptimusPerfect, features, fit_speed, nnls, predicted_speed
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import load_workload

from tests.policies.test_tiresias import assert_pure, job, view, views


def model_curve(theta: tuple[float, ...], n: int) -> tuple[float, ...]:
    """A throughput curve that follows the all-reduce speed model exactly."""
    return (
        0.0,
        *(1.0 / sum(t * x for t, x in zip(theta, features(w), strict=True)) for w in range(1, n + 1)),
    )


@settings(max_examples=40, deadline=None)
@given(
    hs.integers(2, 12).flatmap(
        lambda m: hs.tuples(
            hs.lists(hs.integers(-1000, 1000).map(lambda i: i / 100), min_size=m * 4, max_size=m * 4),
            hs.lists(hs.integers(-1000, 1000).map(lambda i: i / 100), min_size=m, max_size=m),
        )
    )
)
def test_nnls_matches_scipy(ab: tuple[list[float], list[float]]) -> None:
    scipy_optimize = pytest.importorskip("scipy.optimize")
    flat, b = ab
    a = np.array(flat).reshape(len(b), 4)
    ours = nnls(a, np.array(b))
    ref, _ = scipy_optimize.nnls(a, np.array(b))
    assert (ours >= 0).all()
    # Same optimum (the minimiser may differ when a is rank-deficient).
    assert np.linalg.norm(a @ ours - b) == pytest.approx(np.linalg.norm(a @ ref - b), rel=1e-6, abs=1e-9)


def test_fit_recovers_a_curve_of_the_model_form() -> None:
    curve = model_curve((2.0, 0.1, 0.3, 0.01), 16)
    theta = fit_speed(curve)
    for w in range(1, 17):
        assert predicted_speed(theta, w) == pytest.approx(curve[w], rel=1e-6)


def test_fit_of_the_afs_profiles_is_within_ten_percent_on_average() -> None:
    # Optimus Fig. 8: under 10% speed-estimation error (here: mean over all counts).
    catalog = afs_catalog()
    for model in AFS_TABLE4_MODELS:
        curve = catalog.curve(model, "").throughput
        theta = fit_speed(tuple(curve))
        errors = [abs(predicted_speed(theta, w) - curve[w]) / curve[w] for w in range(1, len(curve))]
        assert sum(errors) / len(errors) < 0.10, model


def test_marginal_gain_picks_the_steepest_curve() -> None:
    # Both start on 1 GPU (step 1). One GPU is left: a linear job saves 100/1 - 100/2 = 50 s,
    # a job with a large constant term saves 100/0.5 - 100/0.667 = 50 s only with Q = 100,
    # so with Q = 50 it saves 25 s: the linear job gets the GPU.
    linear = model_curve((1.0, 0.0, 0.0, 0.0), 4)
    flat = model_curve((1.0, 1.0, 0.0, 0.0), 4)
    a = job("a", arrival_s=1.0, requested_gpus=4, max_gpus=4, throughput=linear, remaining_iterations=100.0)
    b = job("b", arrival_s=0.0, requested_gpus=4, max_gpus=4, throughput=flat, remaining_iterations=50.0)
    assert Optimus().decide(view(0.0, 3, a, b), {}).shares == {"a": 2, "b": 1}
    # With Q = 300, b saves 600 - 450 = 150 s against a's 50 s: b gets it.
    b3 = job("b", arrival_s=0.0, requested_gpus=4, max_gpus=4, throughput=flat, remaining_iterations=300.0)
    assert Optimus().decide(view(0.0, 3, a, b3), {}).shares == {"a": 1, "b": 2}


def test_stops_when_no_step_gains() -> None:
    # A curve that stops rising at 2 GPUs: with perfect estimates (AFS §5.1) Optimus
    # gives exactly 2 and leaves the rest idle; a third GPU would gain nothing.
    flat = (0.0, 1.0, 1.5, 1.5, 1.5)
    j = job("j", requested_gpus=4, max_gpus=4, throughput=flat, remaining_iterations=100.0)
    assert OptimusPerfect().decide(view(0.0, 4, j), {}).shares == {"j": 2}
    # The fitted model is smooth and predicts a gain at 3 (1.47 -> 1.55 it/s) but none
    # at 4: it stops where its own speeds stop rising.
    fitted = Optimus()
    assert fitted.decide(view(0.0, 4, j), {}).shares == {"j": 3}
    speeds = fitted.speeds(j, (1, 2, 3, 4))
    assert speeds[2] > speeds[1] and speeds[3] <= speeds[2]


def _planned_speeds(policy: Optimus, j: JobView, share: int) -> tuple[float, float]:
    counts = policy.counts(j)
    k = counts.index(share)
    speeds = policy.speeds(j, counts)
    return speeds[k - 1], speeds[k]


@settings(max_examples=80, deadline=None)
@given(views(), hs.booleans())
def test_every_step_above_the_smallest_allocation_gains(v: ClusterView, perfect: bool) -> None:
    """Eq. (9): a job holds more than its smallest allocation only if the last step
    made it faster on the speeds Optimus planned on (the true ones when perfect)."""
    policy = OptimusPerfect(cap_at_request=False) if perfect else Optimus(cap_at_request=False)
    shares = policy.decide(v, {}).shares
    for j in v.jobs:
        share = shares.get(j.job_id, 0)
        if share and share != policy.counts(j)[0]:
            before, after = _planned_speeds(policy, j, share)
            assert after > before, (j.job_id, share, before, after)


def test_perfect_estimates_plan_on_the_true_curve() -> None:
    curve = (0.0, 1.0, 1.9, 2.1, 2.2)
    j = job("j", requested_gpus=4, max_gpus=4, throughput=curve, remaining_iterations=10.0)
    assert OptimusPerfect().speeds(j, (1, 2, 3, 4)) == curve[1:]
    assert Optimus().speeds(j, (1, 2, 3, 4)) != curve[1:]
    with pytest.raises(ValueError, match="estimates"):
        Optimus(estimates="psychic")


def test_cap_at_request_and_starvation_avoidance() -> None:
    jobs = [
        job(f"j{i}", arrival_s=float(i), requested_gpus=2, max_gpus=8, remaining_iterations=100.0)
        for i in range(3)
    ]
    capped = Optimus().decide(view(0.0, 8, *jobs), {}).shares
    assert capped == {"j0": 2, "j1": 2, "j2": 2}
    free = Optimus(cap_at_request=False).decide(view(0.0, 8, *jobs), {}).shares
    assert sum(free.values()) == 8 and min(free.values()) >= 1
    # More jobs than GPUs: the earliest arrivals get their first GPU.
    many = Optimus().decide(view(0.0, 2, *jobs), {}).shares
    assert many == {"j0": 1, "j1": 1}


@settings(max_examples=60, deadline=None)
@given(views())
def test_properties(v: ClusterView) -> None:
    assert_pure(Optimus(cap_at_request=False), v)
    assert_pure(Optimus(fit_counts=(1, 2, 4)), v)
    assert_pure(OptimusPerfect(), v)


class _WalkingAll(Optimus):
    """Optimus looking at every job of the queue (the form before the early stop)."""

    _stop_when_full = False


@settings(max_examples=200, deadline=None)
@given(views(max_jobs=20), hs.booleans(), hs.booleans())
def test_stopping_when_the_gpus_run_out_decides_as_walking_every_job(
    v: ClusterView, cap: bool, arrival_ordered: bool
) -> None:
    if arrival_ordered:
        v = ClusterView(
            now_s=v.now_s,
            total_gpus=v.total_gpus,
            jobs=tuple(sorted(v.jobs, key=lambda j: (j.arrival_s, j.job_id))),
            arrival_ordered=True,
        )
    assert Optimus(cap_at_request=cap).decide(v, {}) == _WalkingAll(cap_at_request=cap).decide(v, {})


def test_runs_a_philly_prefix_to_completion() -> None:
    workload = load_workload("philly:2869ce:150", seed=0)
    summary = Simulator(workload, Optimus(), SimConfig(flat=True)).run().summary
    assert summary["completed"] == summary["jobs"] == 150

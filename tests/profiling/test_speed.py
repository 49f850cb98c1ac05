"""Optimus §3.2 speed fit (all-reduce form) and the numpy Lawson–Hanson NNLS."""

from __future__ import annotations

import csv
import gzip
import math
from importlib import resources

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp
from shoal.profiling.speed import SpeedModel, canonical_theta, features, fit_speed, nnls

scipy_optimize = pytest.importorskip("scipy.optimize")

finite = hs.one_of(hs.just(0.0), hs.floats(-100, 100).filter(lambda v: abs(v) > 1e-6))


@settings(max_examples=150, deadline=None)
@given(hs.integers(1, 12), hs.integers(1, 8), hs.data())
def test_nnls_matches_scipy(m: int, n: int, data: hs.DataObject) -> None:
    a = data.draw(hnp.arrays(float, (m, n), elements=finite))
    b = data.draw(hnp.arrays(float, (m,), elements=finite))
    x = nnls(a, b)
    ref, _ = scipy_optimize.nnls(a, b)
    assert np.all(x >= 0)
    scale = 1.0 + np.linalg.norm(a) * (1.0 + np.linalg.norm(b))
    assert np.linalg.norm(a @ x - b) <= np.linalg.norm(a @ ref - b) + 1e-9 * scale


def test_nnls_recovers_a_nonnegative_solution_exactly() -> None:
    rng = np.random.default_rng(7)
    a = rng.uniform(0.1, 2.0, size=(20, 5))
    truth = np.array([0.5, 0.0, 2.0, 0.0, 1.25])
    assert nnls(a, a @ truth) == pytest.approx(truth, abs=1e-10)


def test_nnls_rejects_bad_shapes_and_nan() -> None:
    with pytest.raises(ValueError, match="nnls needs"):
        nnls(np.ones((3, 2)), np.ones(2))
    with pytest.raises(ValueError, match="finite"):
        nnls(np.array([[1.0, math.nan]]), np.array([1.0]))


def truth_speed(theta: tuple[float, float, float, float], batch: float, w: int) -> float:
    return 1.0 / sum(t * f for t, f in zip(theta, features(w, batch), strict=True))


def test_canonical_parameters_are_recovered() -> None:
    theta = canonical_theta((0.002, 0.01, 0.0, 0.0008), 256.0)
    points = {w: truth_speed(theta, 256.0, w) for w in (1, 2, 4, 8, 16)}
    model = fit_speed(points, global_batch=256)
    assert model.theta == pytest.approx(theta, rel=1e-6, abs=1e-12)
    assert model.points == 5 and model.rel_error < 1e-9


def test_communication_bound_job_needs_theta2() -> None:
    # Speed falls from one GPU to two: only a positive all-reduce term θ2 explains it.
    theta = (0.0001, 0.01, 0.2, 0.001)
    points = {w: truth_speed(theta, 64.0, w) for w in (1, 2, 3, 4, 8)}
    assert points[2] < points[1]
    model = fit_speed(points, global_batch=64)
    assert model.theta[2] > 0
    assert model.theta == pytest.approx(canonical_theta(theta, 64.0), rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(
    hs.tuples(*(hs.floats(0.0, 1.0) for _ in range(4))).filter(lambda t: t[0] + t[1] > 1e-3),
    hs.sampled_from([1.0, 32.0, 256.0]),
)
def test_any_parameters_are_recovered_up_to_equivalence(
    theta: tuple[float, float, float, float], batch: float
) -> None:
    points = {w: truth_speed(theta, batch, w) for w in (1, 2, 4, 8, 16, 32)}
    model = fit_speed(points, global_batch=batch)
    for w in range(1, 65):
        assert model.throughput(w) == pytest.approx(truth_speed(theta, batch, w), rel=1e-5)


def test_noisy_measurements_give_a_close_curve() -> None:
    theta = (0.003, 0.02, 0.03, 0.0005)
    rng = np.random.default_rng(3)
    rows = [
        (w, truth_speed(theta, 128.0, w) * (1 + rng.normal(0, 0.03)))
        for w in (1, 2, 4, 8, 16)
        for _ in range(5)
    ]
    model = fit_speed(rows, global_batch=128)
    for w in (3, 6, 12, 24):
        assert model.throughput(w) == pytest.approx(truth_speed(theta, 128.0, w), rel=0.05)


def test_bad_points_are_ignored_and_none_left_is_an_error() -> None:
    model = fit_speed({1: 2.0, 2: 3.5, 4: 5.0, 8: math.nan, 0: 1.0, 16: -1.0})
    assert model.points == 3
    with pytest.raises(ValueError, match="at least one"):
        fit_speed({1: math.inf, 2: 0.0})


def test_model_helpers() -> None:
    model = SpeedModel(theta=(0.0, 0.5, 0.0, 0.0))
    assert model.curve(2) == (0.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="positive"):
        model.step_time(-1)


def afs_anchor_curves() -> dict[str, tuple[int, dict[int, float]]]:
    path = resources.files("shoal") / "data" / "afs_model_speedups.csv.gz"
    out: dict[str, tuple[int, dict[int, float]]] = {}
    with gzip.open(str(path), "rt") as fh:
        for row in csv.DictReader(fh):
            _batch, curve = out.setdefault(row["afs_model_class"], (int(row["batch_size"]), {}))
            if row["is_anchor_point"] == "1":
                curve[int(row["num_gpus"])] = float(row["throughput_iters_per_s"])
    return out


def test_fit_explains_afs_measured_curves_within_optimus_10_percent() -> None:
    """Optimus Fig. 8 claims < 10 % speed error; check the all-reduce form on the AFS
    measured (anchor) points of the nine models: fit on all anchors, error at each."""
    worst = {}
    for name, (batch, anchors) in afs_anchor_curves().items():
        model = fit_speed(anchors, global_batch=batch)
        worst[name] = model.rel_error
    assert len(worst) >= 9
    assert max(worst.values()) < 0.10, worst


def test_the_profiler_names_the_speed_fit_as_the_fit_does() -> None:
    """shoal.profiling keeps its own copy of the fit's model_kind (it imports the fit,
    and numpy, only where a fit runs)."""
    import shoal.profiling as profiling
    from shoal.profiling import speed

    assert profiling.MODEL_KIND == speed.MODEL_KIND
    assert profiling.MODEL_KIND in profiling.PROFILER_KINDS

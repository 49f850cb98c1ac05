"""Optimus §3.1 convergence fit l = 1/(β0·k+β1)+β2 and its predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from shoal.profiling.convergence import ConvergenceModel, clean_losses, curve_reaching, fit_convergence

# Optimus Fig. 7 (Seq2Seq): β0 = 0.21, β1 = 1.07, β2 = 0.07.
FIG7 = (0.21, 1.07, 0.07)


def curve(beta: tuple[float, float, float], ks: np.ndarray) -> np.ndarray:
    return 1.0 / (beta[0] * ks + beta[1]) + beta[2]


def test_exact_curve_recovers_parameters() -> None:
    ks = np.arange(0, 80)
    model = fit_convergence(list(zip(ks.tolist(), curve(FIG7, ks).tolist(), strict=True)))
    assert (model.beta0, model.beta1, model.beta2) == pytest.approx(FIG7, rel=1e-4)
    assert model.samples == 80 and model.rmse < 1e-8


def test_parameters_are_in_the_jobs_loss_units() -> None:
    ks = np.arange(0, 80)
    model = fit_convergence(dict(zip(ks.tolist(), (4.0 * curve(FIG7, ks)).tolist(), strict=True)))
    assert model.beta0 == pytest.approx(FIG7[0] / 4, rel=1e-4)
    assert model.beta1 == pytest.approx(FIG7[1] / 4, rel=1e-4)
    assert model.beta2 == pytest.approx(FIG7[2] * 4, rel=1e-4)


def test_noisy_curve_predicts_the_remaining_iterations() -> None:
    beta = (0.02, 0.5, 0.3)
    ks = np.arange(0, 2000, 10)
    rng = np.random.default_rng(11)
    noisy = curve(beta, ks) * (1 + rng.normal(0, 0.02, len(ks)))
    model = fit_convergence(list(zip(ks.tolist(), noisy.tolist(), strict=True)))
    target = 0.35
    true_k = (1 / (target - beta[2]) - beta[1]) / beta[0]
    k = model.iterations_to_loss(target)
    assert k is not None and k == pytest.approx(true_k, rel=0.10)
    remaining = model.remaining_iterations(target, done=500)
    assert remaining is not None and remaining == pytest.approx(k - 500)


def test_outliers_are_replaced_before_fitting() -> None:
    ks = np.arange(0, 60)
    losses = curve(FIG7, ks)
    spiked = losses.copy()
    spiked[30] = 5.0
    cleaned = dict(clean_losses(list(zip(ks.tolist(), spiked.tolist(), strict=True))))
    assert cleaned[30] == pytest.approx((losses[29] + losses[31]) / 2)
    model = fit_convergence(list(zip(ks.tolist(), spiked.tolist(), strict=True)))
    assert model.beta2 == pytest.approx(FIG7[2], rel=0.02)


def test_nonsense_points_are_dropped() -> None:
    pts = [(0, 1.0), (1, math.nan), (2, -1.0), (-5, 0.5), (3, math.inf), (10, 0.5), (20, 0.4), (20, 0.2)]
    assert clean_losses(pts) == [(0, 1.0), (10, 0.5), (20, pytest.approx(0.3))]


def test_too_few_points_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 distinct"):
        fit_convergence([(0, 1.0), (1, 0.9), (1, 0.8)])
    with pytest.raises(ValueError, match="positive loss"):
        fit_convergence([(0, 0.0), (1, 0.0), (2, 0.0)])


def test_unreachable_targets() -> None:
    model = ConvergenceModel(beta0=0.1, beta1=1.0, beta2=0.2)
    assert model.iterations_to_loss(0.2) is None
    assert model.iterations_to_loss(0.1) is None
    assert model.iterations_to_loss(math.nan) is None
    assert model.iterations_to_loss(5.0) == 0.0
    assert ConvergenceModel(beta0=0.0, beta1=1.0, beta2=0.2).iterations_to_loss(0.5) is None


def test_plateau_rule_matches_the_closed_form() -> None:
    model = ConvergenceModel(beta0=0.05, beta1=1.0, beta2=0.1)
    k_epoch, delta = 100.0, 0.001
    k = model.iterations_to_plateau(delta, k_epoch)
    assert k is not None
    assert model.loss(k) - model.loss(k + k_epoch) == pytest.approx(delta, rel=1e-9)
    assert model.loss(k - 1) - model.loss(k - 1 + k_epoch) > delta
    assert model.iterations_to_plateau(0.0, k_epoch) is None


def test_closed_form_two_variable_nnls_matches_lawson_hanson() -> None:
    from shoal.profiling.convergence import _fit_beta2s
    from shoal.profiling.speed import nnls

    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(3, 30))
        k = np.sort(rng.uniform(0, 1000, n))
        loss = rng.uniform(0.05, 1.0, n)
        beta2 = np.array([0.0, float(loss.min()) * 0.5, float(loss.min()) * 0.99])
        b0, b1, _ = _fit_beta2s(k, loss, beta2)
        for i, c in enumerate(beta2):
            gap = loss - c
            wt = gap * gap
            ref = nnls(np.column_stack((k * wt, wt)), wt / gap)
            a = np.column_stack((k * wt, wt))
            mine = np.linalg.norm(a @ np.array([b0[i], b1[i]]) - wt / gap)
            best = np.linalg.norm(a @ ref - wt / gap)
            assert b0[i] >= 0 and b1[i] >= 0
            assert mine <= best + 1e-9 * (1 + best)


def test_curve_reaching_hits_the_target_at_the_given_iteration_and_is_fitted_back() -> None:
    curve = curve_reaching(0.5, 300)
    assert curve.loss(0) == pytest.approx(5.0)
    assert curve.loss(300) == pytest.approx(0.5)
    assert curve.iterations_to_loss(0.5) == pytest.approx(300)
    fit = fit_convergence([(k, curve.loss(k)) for k in range(0, 200, 10)])
    assert fit is not None and fit.iterations_to_loss(0.5) == pytest.approx(300, rel=0.01)
    with pytest.raises(ValueError):
        curve_reaching(0.5, 0)
    with pytest.raises(ValueError):
        curve_reaching(0.5, 10, initial_loss=0.4)

"""Accuracy-based epoch prediction (SideCar §III.C, issue 23 point 5)."""

from __future__ import annotations

import math
import random

import pytest
from shoal.profiling.accuracy import fit_accuracy, predict_total_iterations


def _acc(k: float, b0: float = 0.002, b1: float = 1.5, b2: float = 0.85) -> float:
    return b2 - 1.0 / (b0 * k + b1)


def test_fit_recovers_an_exact_curve() -> None:
    pts = [(k, _acc(k)) for k in (1, 5, 10, 20, 200, 500, 1000, 2000)]
    fit = fit_accuracy(pts)
    assert fit is not None
    assert fit.beta0 >= 0 and fit.beta1 >= 0
    assert fit.beta2 == pytest.approx(0.85, abs=1e-3)
    assert fit.iterations_to(_acc(8000)) == pytest.approx(8000, rel=0.02)
    assert math.isinf(fit.iterations_to(0.99))


def test_prediction_from_noisy_samples_is_close() -> None:
    rng = random.Random(1)
    pts = [(float(k), _acc(k) + rng.gauss(0, 0.003)) for k in range(100, 4000, 100)]
    predicted = predict_total_iterations(pts, _acc(8000))
    assert predicted is not None and predicted == pytest.approx(8000, rel=0.25)


def test_nothing_to_fit() -> None:
    assert fit_accuracy([(10, 0.1)]) is None
    assert predict_total_iterations([], 0.5) is None

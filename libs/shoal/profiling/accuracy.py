"""Accuracy-based epoch prediction for jobs that stop at a target accuracy (SideCar §III.C, W4).

SideCar predicts the remaining epochs of a job without an epoch count by fitting its
accuracy curve online, Optimus-style (NNLS), from the offline accuracy profile plus the
points ``(iterations, accuracy)`` seen during training. The paper does not give the
curve (NOTES 4.1.C, 4.5 item 6); this module takes Optimus's loss form mirrored::

    acc(k) = β2 − 1 / (β0·k + β1),   β0, β1 ≥ 0

For a fixed ``β2`` the model is linear in ``(β0, β1)`` after ``y = 1 / (β2 − acc)``,
solved by non-negative least squares; ``β2`` is searched on a grid above the highest
accuracy seen (up to 1), keeping the fit with the least squared error in accuracy.
Pure functions; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from msgspec import Struct


class AccuracyFit(Struct, frozen=True):
    """``acc(k) = beta2 − 1 / (beta0·k + beta1)``."""

    beta0: float
    beta1: float
    beta2: float
    sse: float

    def accuracy(self, iterations: float) -> float:
        """The fitted accuracy after ``iterations``."""
        d = self.beta0 * iterations + self.beta1
        return self.beta2 - 1.0 / d if d > 0 else -math.inf

    def iterations_to(self, target: float) -> float:
        """Iterations at which the fit reaches ``target`` (``inf`` if it never does)."""
        if target >= self.beta2 or self.beta0 <= 0:
            return math.inf
        return max(0.0, (1.0 / (self.beta2 - target) - self.beta1) / self.beta0)


def _nnls2(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y ≈ b0·x + b1`` with ``b0, b1 ≥ 0`` (two variables: try the
    unconstrained solution, then each coefficient at 0)."""
    n = len(xs)
    sx, sy = sum(xs), sum(ys)
    sxx = sum(x * x for x in xs)
    sxy = sum(x * y for x, y in zip(xs, ys, strict=True))
    det = n * sxx - sx * sx
    candidates: list[tuple[float, float]] = []
    if det > 0:
        b0 = (n * sxy - sx * sy) / det
        b1 = (sy - b0 * sx) / n
        if b0 >= 0 and b1 >= 0:
            return b0, b1
    if sxx > 0:
        candidates.append((max(0.0, sxy / sxx), 0.0))
    candidates.append((0.0, max(0.0, sy / n)))

    def err(c: tuple[float, float]) -> float:
        return sum((c[0] * x + c[1] - y) ** 2 for x, y in zip(xs, ys, strict=True))

    return min(candidates, key=err)


def fit_accuracy(points: Sequence[tuple[float, float]], *, grid: int = 200) -> AccuracyFit | None:
    """Fit ``(iterations, accuracy)`` points; ``None`` with fewer than two distinct iterations.

    Args:
        points: observed ``(iterations, accuracy)`` pairs, accuracy in [0, 1).
        grid: number of ``β2`` candidates between the highest accuracy seen and 1.
    """
    pts = [(float(k), float(a)) for k, a in points if a < 1.0]
    if len({k for k, _ in pts}) < 2:
        return None
    top = max(a for _, a in pts)
    xs = [k for k, _ in pts]
    best: AccuracyFit | None = None
    gap = 1.0 - top
    for i in range(1, grid + 1):
        beta2 = top + gap * (i / grid) ** 2  # denser near the highest accuracy seen
        ys = [1.0 / (beta2 - a) for _, a in pts]
        b0, b1 = _nnls2(xs, ys)
        fit = AccuracyFit(b0, b1, beta2, 0.0)
        sse = sum((fit.accuracy(k) - a) ** 2 for k, a in pts)
        if best is None or sse < best.sse:
            best = AccuracyFit(b0, b1, beta2, sse)
    return best


def predict_total_iterations(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Iterations a job needs to reach ``target`` accuracy by the fit of ``points``
    (``None`` when there is nothing to fit; at least the largest iteration count seen)."""
    fit = fit_accuracy(points)
    if fit is None:
        return None
    seen = max(k for k, _ in points)
    return max(seen, fit.iterations_to(target))

"""Optimus §3.1 online convergence fit ``l = 1/(β0·k + β1) + β2`` — pure.

Optimus fits the training loss ``l`` at step ``k`` with eq. (1), β0, β1, β2 ≥ 0
(SGD converges as O(1/k)), refits on all points after every step, and predicts
the steps left to convergence. Eq. (1) is not linear in β, so "NNLS" needs a
reformulation (REPRODUCTION.md). The one used here:

1. **Clean** (§3.1 preprocessing). Non-finite or negative losses and negative
   iterations are dropped (eq. (1) is positive). Points are sorted by iteration;
   repeats of one iteration are averaged. A point outside
   ``[min of the next 5, max of the previous 5]`` is an outlier and is replaced by
   the mean of its two neighbours (§3.1 uses epochs; we use report points).
2. **Normalise** by the largest loss, so losses lie in ``(0, 1]`` (§3.1).
3. **Profile β2.** For a fixed β2 < min l, ``y = 1/(l − β2) = β0·k + β1`` is linear
   in (β0, β1) and is solved by NNLS (two variables: in closed form). Rows
   are weighted by ``(l − β2)²`` so the linear residual approximates the residual
   in ``l`` (``d l ≈ −d y / y²``). β2 is searched on a grid of
   ``grid`` points in ``[0, min l)``, then refined by ``refine_steps`` zooms (a
   new grid between the best point's neighbours; resolution ``min l / grid^(r+1)``); the β2 with the smallest residual sum of squares **in l**
   wins (not in y, which would over-weight the tail).
4. **Un-normalise**: with ``L = s·l``, ``β0 ← β0/s``, ``β1 ← β1/s``, ``β2 ← s·β2``,
   so β are reported in the job's own loss units.

Predictions. :meth:`ConvergenceModel.iterations_to_loss` solves eq. (1) for the
step where the loss reaches a target (``None`` when the target is at or below the
asymptote β2, or the loss does not fall). :meth:`ConvergenceModel.iterations_to_plateau`
implements Optimus's stopping rule: the first step ``k`` where the decrease over
one epoch of ``K`` steps, ``l(k) − l(k+K) = β0·K / ((β0·k+β1)(β0·(k+K)+β1))``,
falls below ``delta``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
from msgspec import Struct


class ConvergenceModel(Struct, frozen=True, kw_only=True):
    """A fitted ``l(k) = 1/(β0·k + β1) + β2`` (β in the job's loss units)."""

    beta0: float
    beta1: float
    beta2: float
    samples: int = 0
    """Distinct iterations the fit used."""
    rmse: float = 0.0
    """Root-mean-square error of the fit on the cleaned points (loss units)."""

    def loss(self, k: float) -> float:
        """Predicted loss at iteration ``k``."""
        p = self.beta0 * k + self.beta1
        return math.inf if p <= 0 else 1.0 / p + self.beta2

    def iterations_to_loss(self, target_loss: float) -> float | None:
        """The iteration at which the predicted loss reaches ``target_loss``.

        Returns:
            ``k`` (0 when the curve starts at or below the target), or ``None``
            when the target is unreachable (at or below β2, or β0 = 0).
        """
        if not math.isfinite(target_loss):
            return None
        if target_loss <= self.beta2:
            return None
        if self.loss(0.0) <= target_loss:
            return 0.0
        if self.beta0 <= 0:
            return None
        return max(0.0, (1.0 / (target_loss - self.beta2) - self.beta1) / self.beta0)

    def remaining_iterations(self, target_loss: float, done: float = 0.0) -> float | None:
        """Iterations left from ``done`` until the loss reaches ``target_loss`` (Optimus §3.1).

        Returns:
            ``max(0, k* − done)``, or ``None`` when the target is unreachable.
        """
        k = self.iterations_to_loss(target_loss)
        return None if k is None else max(0.0, k - done)

    def iterations_to_plateau(self, delta: float, steps_per_epoch: float) -> float | None:
        """Optimus's criterion: first ``k`` with ``l(k) − l(k+K) < delta`` (``K`` = steps per epoch).

        Returns:
            ``k``, or ``None`` for a non-positive ``delta`` or ``K``.
        """
        if delta <= 0 or steps_per_epoch <= 0 or not math.isfinite(delta):
            return None
        if self.beta0 <= 0:
            return 0.0
        bk = self.beta0 * steps_per_epoch
        # u = β0·k + β1 solves u·(u + bk) = bk/δ.
        u = (-bk + math.sqrt(bk * bk + 4.0 * bk / delta)) / 2.0
        return max(0.0, (u - self.beta1) / self.beta0)


def curve_reaching(
    target_loss: float, iterations: float, initial_loss: float | None = None
) -> ConvergenceModel:
    """A loss curve of eq. (1) that reaches ``target_loss`` at ``iterations`` steps.

    For emulated trainers, which have no real loss: ``β2 = target/2`` (the asymptote
    below the target), ``l(0) = initial_loss`` (default ``10·target``), and β0 so that
    ``l(iterations) = target``. The profiler's fit (:func:`fit_convergence`) recovers
    it from the reported points.

    Raises:
        ValueError: a target that is not finite and positive, ``iterations <= 0``, or an
            initial loss not above the target.
    """
    if not (math.isfinite(target_loss) and target_loss > 0) or not iterations > 0:
        raise ValueError(f"need a finite target > 0 and iterations > 0, got {target_loss}, {iterations}")
    start = 10.0 * target_loss if initial_loss is None else float(initial_loss)
    if not start > target_loss:
        raise ValueError(f"the initial loss {start} must be above the target {target_loss}")
    beta2 = target_loss / 2.0
    beta1 = 1.0 / (start - beta2)
    beta0 = (1.0 / (target_loss - beta2) - beta1) / float(iterations)
    return ConvergenceModel(beta0=beta0, beta1=beta1, beta2=beta2)


def clean_losses(
    points: Mapping[int, float] | Iterable[tuple[int, float]], *, window: int = 5
) -> list[tuple[int, float]]:
    """§3.1 preprocessing: drop nonsense, merge repeats, replace outliers.

    Args:
        points: (iteration, loss) pairs or iteration -> loss.
        window: Neighbours on each side for the outlier test (Optimus: 5).

    Returns:
        (iteration, loss) sorted by iteration, one per iteration.
    """
    items = points.items() if isinstance(points, Mapping) else points
    by_k: dict[int, list[float]] = {}
    for k, loss in items:
        if loss is None or not isinstance(loss, int | float):
            continue
        if int(k) < 0 or not math.isfinite(float(loss)) or float(loss) < 0:
            continue
        by_k.setdefault(int(k), []).append(float(loss))
    ks = sorted(by_k)
    ls = [sum(by_k[k]) / len(by_k[k]) for k in ks]
    out = list(ls)
    for i in range(1, len(ls) - 1):
        prev = ls[max(0, i - window) : i]
        nxt = ls[i + 1 : i + 1 + window]
        if ls[i] > max(prev) or ls[i] < min(nxt):
            out[i] = (ls[i - 1] + ls[i + 1]) / 2.0
    return list(zip(ks, out, strict=True))


def _fit_beta2s(
    k: np.ndarray, loss: np.ndarray, beta2: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(β0, β1, rss in l) for each fixed β2 in ``beta2`` (normalised units), vectorised.

    The weighted 2-variable NNLS ``min Σ (wt·(β0·k + β1) − wt·y)²``, β ≥ 0, is solved in
    closed form: the unconstrained solution when it is non-negative, else the best
    of the two axis solutions (a convex quadratic on the orthant has its minimum
    inside or on a face). It gives what :func:`shoal.profiling.speed.nnls` gives on
    the same rows, a few hundred times faster.
    """
    gap = loss[None, :] - beta2[:, None]  # (G, n)
    wt = gap * gap
    a, c, t = k[None, :] * wt, wt, wt / gap  # rows (a, c) and target t = wt·y
    saa, scc, sac = (a * a).sum(1), (c * c).sum(1), (a * c).sum(1)
    sat, sct = (a * t).sum(1), (c * t).sum(1)
    det = saa * scc - sac * sac
    ok = det > 1e-300 * np.maximum(saa * scc, 1e-300)
    safe = np.where(ok, det, 1.0)
    b0 = np.where(ok, (scc * sat - sac * sct) / safe, -1.0)
    b1 = np.where(ok, (saa * sct - sac * sat) / safe, -1.0)
    interior = (b0 >= 0) & (b1 >= 0)

    def objective(x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
        return x0 * x0 * saa + 2 * x0 * x1 * sac + x1 * x1 * scc - 2 * (x0 * sat + x1 * sct)

    only1 = np.maximum(0.0, sct / np.where(scc > 0, scc, 1.0))  # β0 = 0
    only0 = np.maximum(0.0, sat / np.where(saa > 0, saa, 1.0))  # β1 = 0
    zeros = np.zeros_like(only0)
    use_b1 = objective(zeros, only1) <= objective(only0, zeros)
    b0 = np.where(interior, b0, np.where(use_b1, 0.0, only0))
    b1 = np.where(interior, b1, np.where(use_b1, only1, 0.0))
    p = b0[:, None] * k[None, :] + b1[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        pred = 1.0 / p + beta2[:, None]
    rss = np.where(np.all(p > 0, axis=1), ((pred - loss[None, :]) ** 2).sum(1), np.inf)
    return b0, b1, rss


def fit_convergence(
    points: Mapping[int, float] | Iterable[tuple[int, float]],
    *,
    grid: int = 64,
    refine_steps: int = 3,
    min_points: int = 3,
) -> ConvergenceModel:
    """Fit eq. (1) to (iteration, loss) samples (see the module docstring).

    Args:
        points: (iteration, loss) pairs or iteration -> loss.
        grid: β2 grid points in ``[0, min l)``.
        refine_steps: Zoom rounds (each a ``grid``-point grid between the best point's neighbours).
        min_points: Least distinct iterations (3 parameters).

    Returns:
        The fitted model, β in the job's loss units.

    Raises:
        ValueError: Fewer than ``min_points`` usable points, or every loss is 0.
    """
    pts = clean_losses(points)
    if len(pts) < max(3, min_points):
        raise ValueError(f"fit_convergence needs {max(3, min_points)} distinct iterations, got {len(pts)}")
    k = np.array([p[0] for p in pts], dtype=float)
    raw = np.array([p[1] for p in pts], dtype=float)
    scale = float(raw.max())
    if scale <= 0:
        raise ValueError("fit_convergence needs a positive loss")
    norm = raw / scale
    lo = float(norm.min())
    # Candidates strictly below min l (at min l, y is infinite).
    top = lo * (1.0 - 1e-9)
    candidates = [top * i / grid for i in range(grid)] if lo > 0 else [0.0]
    g0, g1, grss = _fit_beta2s(k, norm, np.array(candidates))
    best_i = int(np.argmin(grss))
    b0, b1, rss, b2 = float(g0[best_i]), float(g1[best_i]), float(grss[best_i]), candidates[best_i]
    # Zoom: a finer grid between the best point's neighbours, ``refine_steps`` times.
    left = candidates[max(0, best_i - 1)]
    right = candidates[best_i + 1] if best_i + 1 < len(candidates) else top
    for _ in range(refine_steps if lo > 0 else 0):
        fine = np.linspace(left, right, grid)
        f0, f1, frss = _fit_beta2s(k, norm, fine)
        i = int(np.argmin(frss))
        if frss[i] < rss:
            b0, b1, rss, b2 = float(f0[i]), float(f1[i]), float(frss[i]), float(fine[i])
        left, right = float(fine[max(0, i - 1)]), float(fine[min(grid - 1, i + 1)])
    return ConvergenceModel(
        beta0=b0 / scale,
        beta1=b1 / scale,
        beta2=b2 * scale,
        samples=len(pts),
        rmse=math.sqrt(rss / len(pts)) * scale,
    )

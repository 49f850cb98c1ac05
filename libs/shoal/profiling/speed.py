"""Optimus §3.2 resource-to-speed model, adapted to all-reduce, fitted by NNLS — pure.

Optimus models a synchronous parameter-server job's time per step (eq. (4)) as
``θ0·M/w + θ1 + θ2·w/p + θ3·w + θ4·p`` and fits the non-negative θ by NNLS. shoal's
jobs are data-parallel with **ring all-reduce** (NCCL/gloo), with no parameter
servers, so the ``p`` terms go and the communication term changes shape. The
model (``model_kind = "optimus-allreduce"``, the form the event contract names) is
the time per iteration with ``w`` GPUs::

    T(w) = θ0·M/w + θ1 + θ2·(w−1)/w + θ3·w          f(w) = 1 / T(w)  (iterations/s)

- ``θ0·M/w``: forward and backward over the per-GPU batch ``M/w`` of a fixed
  global batch ``M`` (Optimus's ``m·T_forward`` with ``m = M/w``).
- ``θ1``: per-iteration work that does not shrink with ``w`` (optimizer step,
  kernel launches; Optimus's ``T_back`` constant).
- ``θ2·(w−1)/w``: ring all-reduce of a model of ``S`` bytes moves
  ``2·S·(w−1)/w`` bytes per GPU, so its bandwidth time is ``θ2·(w−1)/w``
  (replaces Optimus's push/pull term ``θ2·w/p``); zero for one GPU.
- ``θ3·w``: per-GPU overhead (the ring's ``2(w−1)`` latency steps, stragglers;
  Optimus's ``δ·w``). It lets the fitted speed *fall* with more GPUs (Optimus
  Fig. 9).

Identifiability. With a fixed global batch, ``(w−1)/w = 1 − 1/w`` lies in the
span of the ``M/w`` and ``1`` terms (a ring all-reduce's ``2(w−1)·α`` latency
lies in the span of ``1`` and ``w`` for the same reason): only the combinations
``a = θ0·M − θ2``, ``b = θ1 + θ2`` and ``c = θ3`` of ``T(w) = a/w + b + c·w`` are
determined by measurements. The 4-term form is kept because it is the contract
(:class:`shoal.events.ThroughputModelUpdated`) and because its θ ≥ 0 region is
exactly ``{b ≥ 0, c ≥ 0, a + b ≥ 0}``, which admits curves whose speed barely
improves (or drops) from one GPU to two. :func:`fit_speed` returns the
*canonical* θ of the fitted curve: communication ``θ2`` only as large as the
data require (``θ2 = max(0, −a)``), the rest attributed to computation. Tests
therefore recover canonical parameters exactly and any parameters up to this
equivalence (same predicted speeds).

All θ ≥ 0 have a physical meaning, so non-negative least squares is the right
estimator (Optimus fits with NNLS). Linearised as in the notes: the features are
``(M/w, 1, (w−1)/w, w)`` and the target is the measured time per iteration
``1/f``. Each row is divided by its target, so the fit minimises the *relative*
error of the time per iteration (a 10 % miss at 64 GPUs counts as much as one at
one GPU; Optimus reports speed error in percent, Fig. 8). With ``M`` unknown
(``global_batch_size = 0``) ``M = 1`` (θ0 absorbs it).

The solver is Lawson–Hanson active-set NNLS (Lawson & Hanson 1974, ch. 23) in
numpy, the algorithm behind ``scipy.optimize.nnls``; scipy is not a dependency.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from msgspec import Struct

MODEL_KIND = "optimus-allreduce"


def nnls(
    a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None, tol: float | None = None
) -> np.ndarray:
    """Solve ``min ‖A·x − b‖₂`` subject to ``x ≥ 0`` (Lawson–Hanson active set).

    Args:
        a: Matrix ``A`` (m × n).
        b: Vector ``b`` (m).
        max_iter: Outer-iteration bound (default ``3·n``, as scipy).
        tol: Optimality tolerance on the dual (default scaled by ``‖A‖·‖b‖``).

    Returns:
        The solution ``x`` (n), all entries ``≥ 0``.

    Raises:
        ValueError: Shapes disagree or the input is not finite.
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 2 or b.ndim != 1 or a.shape[0] != b.shape[0]:
        raise ValueError(f"nnls needs A (m×n) and b (m); got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("nnls input must be finite")
    m, n = a.shape
    x = np.zeros(n)
    if n == 0 or m == 0:
        return x
    if tol is None:
        # Relative to the scale of the problem (the dual is A^T·r).
        tol = (
            10
            * max(m, n)
            * float(np.finfo(float).eps)
            * float(np.linalg.norm(a, 1))
            * float(np.linalg.norm(b, np.inf))
        )
    max_iter = 3 * n if max_iter is None else max_iter
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        j = int(np.argmax(np.where(candidates, w, -np.inf)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            idx = np.flatnonzero(passive)
            z[idx] = np.linalg.lstsq(a[:, idx], b, rcond=None)[0]
            if np.all(z[idx] > 0):
                x = z
                break
            # Step back towards x until a passive variable hits zero; drop it.
            neg = idx[z[idx] <= 0]
            denom = x[neg] - z[neg]
            ratios = np.where(denom > 0, x[neg] / np.where(denom > 0, denom, 1.0), 0.0)
            k = int(np.argmin(ratios))
            x = x + float(ratios[k]) * (z - x)
            x[neg[k]] = 0.0
            passive &= x > 0
            x[~passive] = 0.0
            if not passive.any():
                break
        w = a.T @ (b - a @ x)
    return x


def features(w: int, global_batch: float = 1.0) -> tuple[float, float, float, float]:
    """The four regressors of the all-reduce model at ``w`` GPUs."""
    return (global_batch / w, 1.0, (w - 1) / w, float(w))


class SpeedModel(Struct, frozen=True, kw_only=True):
    """A fitted ``f(w) = 1 / (θ0·M/w + θ1 + θ2·(w−1)/w + θ3·w)``."""

    theta: tuple[float, float, float, float]
    global_batch: float = 1.0
    points: int = 0
    """Distinct GPU counts the fit used."""
    rel_error: float = 0.0
    """Largest relative error of the fitted speed at a fitted point."""

    def step_time(self, w: int) -> float:
        """Predicted seconds per iteration at ``w`` GPUs."""
        if w <= 0:
            raise ValueError(f"GPU count must be positive, got {w}")
        return float(sum(t * f for t, f in zip(self.theta, features(w, self.global_batch), strict=True)))

    def throughput(self, w: int) -> float:
        """Predicted iterations/s at ``w`` GPUs (0 for ``w == 0``)."""
        if w == 0:
            return 0.0
        t = self.step_time(w)
        return 1.0 / t if t > 0 else math.inf

    def curve(self, max_gpus: int) -> tuple[float, ...]:
        """Iterations/s at index ``0..max_gpus``."""
        return tuple(self.throughput(k) for k in range(max_gpus + 1))


def fit_speed(
    points: Mapping[int, float] | Sequence[tuple[int, float]],
    *,
    global_batch: float = 0.0,
) -> SpeedModel:
    """Fit the all-reduce speed model to measured throughputs by NNLS (Optimus §3.2).

    Args:
        points: GPU count -> measured iterations/s, or (count, iterations/s) pairs
            (repeats allowed: every pair is a row, as Optimus adds each run).
            Non-positive or non-finite entries are ignored.
        global_batch: ``M`` (samples per iteration); 0 or less means unknown (1).

    Returns:
        The fitted model.

    Raises:
        ValueError: No usable point.
    """
    items = points.items() if isinstance(points, Mapping) else points
    rows = [(int(w), float(f)) for w, f in items if int(w) > 0 and math.isfinite(float(f)) and float(f) > 0]
    if not rows:
        raise ValueError("fit_speed needs at least one positive, finite measurement")
    m = float(global_batch) if global_batch > 0 else 1.0
    a = np.array([features(w, m) for w, _ in rows])
    t = np.array([1.0 / f for _, f in rows])
    # Relative error in time per iteration: divide each row by its target.
    theta = nnls(a / t[:, None], np.ones(len(rows)))
    model = SpeedModel(theta=canonical_theta(tuple(float(x) for x in theta), m), global_batch=m)
    err = max(abs(model.throughput(w) - f) / f for w, f in rows)
    return SpeedModel(
        theta=model.theta, global_batch=m, points=len({w for w, _ in rows}), rel_error=float(err)
    )


def canonical_theta(theta: Sequence[float], global_batch: float = 1.0) -> tuple[float, float, float, float]:
    """The canonical θ predicting the same speeds as ``theta`` (see the module docstring).

    Args:
        theta: θ0..θ3, all ``≥ 0``.
        global_batch: ``M`` of the model.

    Returns:
        θ with the smallest ``θ2`` that gives the same ``T(w)`` for every ``w``.
    """
    t0, t1, t2, t3 = (float(x) for x in theta)
    a, b = t0 * global_batch - t2, t1 + t2
    c2 = max(0.0, -a)
    return ((a + c2) / global_batch, max(0.0, b - c2), c2, t3)

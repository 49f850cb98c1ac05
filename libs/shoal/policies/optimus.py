"""Optimus: marginal-gain allocation over a fitted resource-to-speed model (EuroSys'18 §3.2, §4.1).

Each round Optimus minimises the sum of the jobs' remaining times ``t_j = Q_j / f_j(w_j)``
(eqs. (5)–(6)): every job first gets its smallest allocation (to avoid starvation,
§4.1), then GPUs go one step at a time to the job with the largest marginal gain
(eq. (9)) ``(Q_j/f_j(w) - Q_j/f_j(w')) / (w' - w)``, until the GPUs run out or no
step gains (§4.1).

Speed model (§3.2, adapted). Eq. (4) is for synchronous parameter-server jobs,
``f(p, w) = (θ0·M/w + θ1 + θ2·w/p + θ3·w + θ4·p)^-1``. shoal's jobs are all-reduce
data-parallel jobs with no parameter servers, so the ``p`` terms go and the
communication terms become those of a ring all-reduce of a fixed global batch ``M``::

    1/f(w) = θ0·(1/w) + θ1 + θ2·(w-1)/w + θ3·(w-1),    θ ≥ 0

``θ0/w``: forward and backward passes over the ``M/w`` samples of each worker (``M`` is
fixed, so it is folded into ``θ0``); ``θ1``: per-step constant work (update, launch);
``θ2·(w-1)/w``: ring all-reduce bandwidth term, ``2(w-1)/w · S/B`` for a model of ``S``
bytes, zero on one GPU; ``θ3·(w-1)``: per-hop latency of the ``2(w-1)`` ring steps and
other overhead growing with the worker count (eq. (2)'s ``δ·w``). The model is linear in
``θ``, so ``θ`` is fitted by non-negative least squares (Lawson–Hanson, :func:`nnls`,
as Optimus uses NNLS) on the job's known throughput points ``JobView.throughput`` (every
count from 1 to the curve's end, or only ``fit_counts`` to mimic Optimus' few sampled
configurations). Rows are weighted by the measured speed, so the fit minimises the
relative error of time per step. Where the fitted ``1/f`` is not positive the measured
point is used instead.

Choices where the paper or AFS leave room:

* Two estimate modes. ``estimates="fitted"`` (the default, :class:`Optimus`) plans on the
  NNLS-fitted speed model above, as Optimus itself does. ``estimates="perfect"``
  (:class:`OptimusPerfect`, policy ``optimus-perfect``) plans on the job's true
  throughput curve: AFS §5.1 runs Optimus "assuming that their estimation is always
  correct", so the AFS reproduction uses this mode. In both, a step that the speeds
  planned on do not make faster is never taken (eq. (9)'s gain must be positive).
* ``Q_j`` is ``remaining_iterations``: AFS gives Optimus perfect estimates (AFS §5.1),
  and the profiler's convergence fit (Optimus §3.1) lands in the same field. A job with
  no estimate at all is taken to need as much again as it has done (at least 1).
* As in AFS (REPRODUCTION.md "GPU caps"), a job is held to its requested GPU count
  (``cap_at_request=True``); ``False`` lets it grow to ``max_gpus``.
* Step 1 (starvation avoidance) goes in arrival order and skips a job whose smallest
  allocation does not fit (it waits; Optimus pauses jobs it cannot place).
* A "step" is the next feasible count (``allowed_gpu_counts``), and its gain is divided
  by the GPUs it adds, so eq. (9) stays a per-GPU gain. GPUs are the only resource, so
  the dominant-resource share of eq. (9) is the GPU count.
* The young-job priority factor of §4.1 is left at the paper's evaluation default (1).
* Re-run on every arrival and completion (AFS); ``interval_s`` adds a periodic re-run
  (the original's 10-minute scheduling interval).

Cost in a long queue: step 1 stops at the first job it reaches with no GPU left (the
rest would get nothing, and eq. (9) has no GPU to hand out), so a decision looks at the
jobs in arrival order only as far as the GPUs go (a test checks it decides as walking
every job).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts
from shoal.policies.common import view_arrival_order
from shoal.policies.tiresias import gang_size

_INF = float("inf")


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares ``argmin ||a x - b||, x ≥ 0`` (Lawson–Hanson active set).

    Args:
        a: ``m × n`` matrix.
        b: length-``m`` vector.
        max_iter: cap on outer iterations (default ``3 n``).

    Returns:
        The solution ``x`` (length ``n``).
    """
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10.0 * np.finfo(float).eps * max(1.0, float(np.abs(a).sum()))
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n):
        if passive.all() or w[~passive].max() <= tol:
            break
        candidates = np.where(~passive, w, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            neg = passive & (s <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - s[neg])))
            x = x + alpha * (s - x)
            passive &= x > tol
            if not passive.any():
                s = np.zeros(n)
                break
        x = s
        w = a.T @ (b - a @ x)
    return x


def features(w: int) -> tuple[float, float, float, float]:
    """Regressors of the all-reduce form of eq. (4): ``1/w, 1, (w-1)/w, w-1``."""
    return (1.0 / w, 1.0, (w - 1) / w, float(w - 1))


@lru_cache(maxsize=8192)
def fit_speed(curve: tuple[float, ...], counts: tuple[int, ...] | None = None) -> tuple[float, ...]:
    """Fitted ``θ`` of the all-reduce speed model from the known points of ``curve``.

    Args:
        curve: iterations/s by GPU count (index 0 unused).
        counts: the counts to fit on (default: every count of the curve with a positive speed).

    Returns:
        ``(θ0, θ1, θ2, θ3)``, all ≥ 0; zeros when no point is usable.
    """
    points = [k for k in (counts or range(1, len(curve))) if 0 < k < len(curve) and curve[k] > 0]
    if not points:
        return (0.0, 0.0, 0.0, 0.0)
    a = np.array([features(k) for k in points], dtype=float)
    speed = np.array([curve[k] for k in points], dtype=float)
    # Weight each row by the measured speed: minimise relative error of time per step.
    theta = nnls(a * speed[:, None], np.ones(len(points)))
    return tuple(float(t) for t in theta)


def predicted_speed(theta: Sequence[float], w: int) -> float:
    """``f(w)`` from fitted ``θ``; 0 when the model gives no positive time per step."""
    if w <= 0:
        return 0.0
    t = sum(c * x for c, x in zip(theta, features(w), strict=True))
    return 1.0 / t if t > 0 else 0.0


@lru_cache(maxsize=8192)
def _speeds(
    curve: tuple[float, ...], counts: tuple[int, ...], fit: tuple[int, ...] | None
) -> tuple[float, ...]:
    theta = fit_speed(curve, fit)
    out = []
    for c in counts:
        s = predicted_speed(theta, c)
        if s <= 0:
            s = curve[c] if c < len(curve) else curve[-1]
        out.append(s)
    return tuple(out)


class Optimus:
    """Optimus (EuroSys'18) for all-reduce GPU jobs; see the module docstring."""

    name = "optimus"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    _stop_when_full = True

    def __init__(
        self,
        *,
        cap_at_request: bool = True,
        fit_counts: Sequence[int] | None = None,
        interval_s: float | None = None,
        estimates: str = "fitted",
    ) -> None:
        """Configure the policy.

        Args:
            cap_at_request: Hold each job to its request (AFS); ``False``: up to ``max_gpus``.
            fit_counts: GPU counts whose measured speed the fit may use (default: all known).
            interval_s: Periodic re-run in seconds (default: only on arrivals and completions).
            estimates: ``"fitted"`` (plan on the fitted speed model) or ``"perfect"``
                (plan on the true throughput curve, as AFS §5.1 runs Optimus).

        Raises:
            ValueError: a non-positive interval or fit count, an unknown estimate mode,
                or ``fit_counts`` with perfect estimates (nothing is fitted).
        """
        if estimates not in ("fitted", "perfect"):
            raise ValueError(f"estimates must be 'fitted' or 'perfect', got {estimates!r}")
        if estimates == "perfect" and fit_counts is not None:
            raise ValueError("fit_counts has no meaning with perfect estimates")
        self.estimates = estimates
        if interval_s is not None:
            if interval_s <= 0:
                raise ValueError(f"interval_s must be positive, got {interval_s}")
            self.tick_s = float(interval_s)
        if fit_counts is not None and any(c <= 0 for c in fit_counts):
            raise ValueError(f"fit_counts must be positive, got {tuple(fit_counts)}")
        self.cap_at_request = cap_at_request
        self.fit_counts = tuple(sorted(set(fit_counts))) if fit_counts is not None else None
        self._counts_by_shape: dict[tuple[Any, ...], tuple[int, ...]] = {}

    def counts(self, job: JobView) -> tuple[int, ...]:
        """The feasible counts Optimus may give ``job`` (memoised on the fields they are
        read from: a decision asks for those of every job it walks, and most jobs share a
        few shapes)."""
        key = (job.elastic, job.requested_gpus, job.min_gpus, job.max_gpus, job.allowed_gpu_counts)
        memo = self._counts_by_shape
        try:
            hit = memo.get(key)
        except TypeError:  # a hand-built view with a list of allowed counts
            return self._counts(job)
        if hit is None:
            hit = self._counts(job)
            if len(memo) < 4096:
                memo[key] = hit
        return hit

    def _counts(self, job: JobView) -> tuple[int, ...]:
        counts = feasible_counts(job)
        if self.cap_at_request and job.elastic:
            cap = gang_size(job)
            counts = tuple(c for c in counts if c <= cap)
        return counts

    def speeds(self, job: JobView, counts: tuple[int, ...]) -> tuple[float, ...]:
        """Speeds (iterations/s) at ``counts`` that the plan uses: fitted, or the true
        curve with perfect estimates (a count past the curve's end: its last point)."""
        if self.estimates == "perfect":
            curve = job.throughput
            return tuple(curve[c] if c < len(curve) else curve[-1] for c in counts)
        return _speeds(tuple(job.throughput), counts, self.fit_counts)

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Step 1 (smallest allocation in arrival order), then eq. (9) greedily."""
        free = view.total_gpus
        state: list[tuple[JobView, tuple[int, ...], tuple[float, ...], float]] = []
        alloc: list[int] = []
        # In arrival order; the simulator's jobs already are (iterated, never copied).
        for job in view.jobs if view.arrival_ordered else view_arrival_order(view):
            if free <= 0 and self._stop_when_full:
                # The GPUs ran out in step 1: no later job gets its smallest allocation
                # and eq. (9) has nothing to give, so the rest of a long queue is not
                # looked at (the decision is the one of walking it all).
                break
            counts = self.counts(job)
            if not counts:
                continue
            speeds = self.speeds(job, counts)
            q = job.remaining_iterations
            if q is None:
                q = max(1.0, job.iterations_done)
            state.append((job, counts, speeds, q))
            # §4.1 step 1: the smallest allocation first, to avoid starvation.
            if counts[0] <= free and speeds[0] > 0:
                alloc.append(0)
                free -= counts[0]
            else:
                alloc.append(-1)

        def gain(i: int) -> tuple[float, int]:
            _, counts, speeds, q = state[i]
            k = alloc[i]
            if k + 1 >= len(counts) or counts[k + 1] - counts[k] > free or speeds[k + 1] <= 0:
                return 0.0, k
            before, after = q / speeds[k], q / speeds[k + 1]
            return (before - after) / (counts[k + 1] - counts[k]), k + 1  # eq. (9)

        heap: list[tuple[float, int]] = []
        for i in range(len(state)):
            if alloc[i] >= 0:
                g, _ = gain(i)
                if g > 0:
                    heap.append((-g, i))
        heapq.heapify(heap)
        while heap and free > 0:
            _, i = heapq.heappop(heap)
            g, k = gain(i)  # free may have shrunk since this entry was pushed
            if g <= 0:
                continue
            counts = state[i][1]
            free -= counts[k] - counts[alloc[i]]
            alloc[i] = k
            g, _ = gain(i)
            if g > 0:
                heapq.heappush(heap, (-g, i))

        shares = {state[i][0].job_id: state[i][1][k] for i, k in enumerate(alloc) if k >= 0}
        return Decision(shares=shares)


class OptimusPerfect(Optimus):
    """Optimus planning on true speeds (``estimates="perfect"``), as AFS §5.1 runs it."""

    name = "optimus-perfect"

    def __init__(self, *, cap_at_request: bool = True, interval_s: float | None = None) -> None:
        super().__init__(cap_at_request=cap_at_request, interval_s=interval_s, estimates="perfect")

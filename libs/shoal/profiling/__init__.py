"""Profiling: the profiler's pure core, from ``ProgressReported`` to model updates.

Modules:

- :mod:`.overestimate` — AFS/CoDDL §4.5, overestimate first and re-adjust later.
- :mod:`.speed` — Optimus §3.2 speed function (adapted to all-reduce), NNLS.
- :mod:`.convergence` — Optimus §3.1 convergence fit ``l = 1/(β0·k+β1)+β2``.
- :mod:`.ratelimit` — when an update is worth publishing.

This module holds :class:`ProfileBook`, the fold of progress reports into
per-job measurements, and the functions that turn a book into the events the
profiler publishes. Everything here is a function of the log: a profiler that
replays the same log builds the same book and proposes the same updates.

Measurement (one sample per accepted report):

- **Iterations/s** of a report, first found wins: ``1/step_time_s``;
  ``samples_per_s / global_batch_size`` (a job that declares no global batch
  reports iterations/s as ``samples_per_s``, as the emulated trainer does); else
  the iterations between two consecutive reports of the job with the same epoch,
  GPU count and type, over their occurred-at difference.
- **Where**: GPU type = the report's ``gpu_type``, else the one the caller says the
  job ran on (``observe(gpu_type=...)``: the profiler service passes the generation of
  the job's newest completed reconfiguration), else the job's current type from the
  newest ``SharesDecided``, else ``""`` (a homogeneous cluster's only generation); GPU
  count = the report's ``num_gpus``, else the job's completed world size, else its
  share.
- **Average of recent samples** per (job, GPU type, GPU count) (Gandiva_fair
  §3.4/§3.5: the profile adapts when a job changes behaviour), with
  :func:`shoal.fairness.hetero.record_sample`: the last ``window`` samples, reset
  when the last ``confirm`` deviate by more than ``change_threshold``.

Bad input is rejected with a specific, counted reason and never enters the book
(:class:`Reason`): unknown or finished job, no GPUs, a count above the job's
``max_gpus``, no rate at all (``step_time_s`` and ``samples_per_s`` both 0 — they
mean "not reported" — and no earlier report to difference against), a rate that
is negative, not finite or implausibly large (``max_rate``), a loss that is not finite or negative. A rejected rate does not
stop a valid loss of the same report from being used, and vice versa.

Model (:func:`throughput_update`): measured counts keep their average; the
others, first found wins:

1. the job's known profile (``JobSpec.profile`` for this GPU type, else for
   ``""``), its shape re-scaled to the measurements
   (:func:`~shoal.profiling.overestimate.calibrate_reference`,
   ``model_kind = "profile-calibrated"``): an offline profile says more about
   scaling than any guess, and measurement still wins where it exists;
2. the Optimus fit, once ``fit_min_counts`` distinct counts are measured and the
   fit explains every measured count within ``fit_max_error`` (Optimus Fig. 8:
   < 10 %; ``model_kind = "optimus-allreduce"``, θ in ``params``);
3. the §4.5 overestimate (``model_kind = "afs-overestimate"``).

``overestimated`` is true only in case 3 while some count up to ``max_gpus`` is
unmeasured; ``measured`` lists the counts that are measurements (the allocator takes a
job on the estimate through its unmeasured smaller units, AFS §4.5,
:func:`~shoal.profiling.overestimate.probe_shares`). At most
``publish_max_counts`` counts are published (the view interpolates the rest).

Convergence (:func:`convergence_update`): the §3.1 fit on the job's (iteration,
loss) points (at most ``loss_points`` kept: the oldest half is merged pairwise
when full, as Optimus averages points of long jobs), used when the job has a
``convergence_target`` (iterations until the fitted loss reaches it) or, with
``plateau_delta`` set and steps per data epoch observed, Optimus's
epoch-to-epoch criterion. An unreachable target publishes nothing (counted).
"""

from __future__ import annotations

import math
from collections import Counter
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from shoal import events as ev
from shoal.fairness.hetero import profiled_rate, record_sample
from shoal.models import interpolate
from shoal.profiling.overestimate import calibrate_reference, estimate_curve, is_overestimated
from shoal.state import FINISHED_STATUSES, JobState

# The fits (numpy) are imported where they run: the simulator and the allocator import
# this package for the §4.5 functions only, and ``shoal simulate`` starts without numpy.
if TYPE_CHECKING:
    from shoal.profiling.convergence import ConvergenceModel

#: ``model_kind`` of an Optimus speed fit (``shoal.profiling.speed.MODEL_KIND``; a test
#: checks they agree).
MODEL_KIND = "optimus-allreduce"

#: ``model_kind`` of a curve that is measured values plus the §4.5 overestimate.
OVERESTIMATE_KIND = "afs-overestimate"
#: ``model_kind`` of measured values plus the job's known profile, re-scaled to them.
PROFILE_KIND = "profile-calibrated"
#: Every ``model_kind`` the profiler publishes (a measurement of the job, not its truth).
PROFILER_KINDS = frozenset({OVERESTIMATE_KIND, PROFILE_KIND, MODEL_KIND})


class Reason(StrEnum):
    """Why a report (or part of it) was not used."""

    UNKNOWN_JOB = "unknown_job"
    FINISHED_JOB = "finished_job"
    NO_GPUS = "no_gpus"
    GPUS_OVER_MAX = "gpus_over_max"
    NO_RATE = "no_rate"
    NEGATIVE_RATE = "negative_rate"
    NONFINITE_RATE = "nonfinite_rate"
    IMPLAUSIBLE_RATE = "implausible_rate"
    NONFINITE_LOSS = "nonfinite_loss"
    NEGATIVE_LOSS = "negative_loss"
    TARGET_UNREACHABLE = "target_unreachable"


class ProfileParams(Struct, frozen=True, kw_only=True):
    """The profiler's modelling choices (all documented in the module docstring)."""

    window: int = 5
    change_threshold: float = 0.25
    confirm: int = 2
    max_rate: float = 1e6
    """Iterations/s above which a sample is nonsense."""
    fit_min_counts: int = 3
    fit_max_error: float = 0.10
    publish_max_counts: int = 1024
    loss_points: int = 512
    convergence_min_points: int = 5
    plateau_delta: float | None = None
    """Optimus's threshold on the normalised loss decrease per epoch (None: off)."""


class _Last(Struct, kw_only=True):
    iteration: int
    at: float
    epoch: int
    num_gpus: int
    gpu_type: str


class ProfileBook:
    """Per-job measurements folded from the log (mutable; owned by one profiler)."""

    def __init__(self, params: ProfileParams | None = None) -> None:
        self.params = params or ProfileParams()
        self.rates: dict[str, dict[str, dict[int, list[float]]]] = {}
        """job -> GPU type -> GPU count -> recent iterations/s samples (oldest first)."""
        self.losses: dict[str, list[tuple[int, float]]] = {}
        self.epoch_starts: dict[str, dict[int, int]] = {}
        """job -> data epoch -> first iteration seen in it (steps per epoch)."""
        self.basis: dict[tuple[str, str], int] = {}
        """(job, GPU type) -> stream sequence of the newest sample (deterministic ids)."""
        self.loss_basis: dict[str, int] = {}
        self.last: dict[str, _Last] = {}
        self.rejected: Counter[str] = Counter()
        self.dirty_models: set[tuple[str, str]] = set()
        self.dirty_convergence: set[str] = set()

    def forget(self, job_id: str) -> None:
        """Drop a finished job's measurements."""
        self.rates.pop(job_id, None)
        self.losses.pop(job_id, None)
        self.epoch_starts.pop(job_id, None)
        self.last.pop(job_id, None)
        self.loss_basis.pop(job_id, None)
        for key in [k for k in self.basis if k[0] == job_id]:
            del self.basis[key]
        self.dirty_models = {k for k in self.dirty_models if k[0] != job_id}
        self.dirty_convergence.discard(job_id)

    def _reject(self, reason: Reason) -> Reason:
        self.rejected[reason.value] += 1
        return reason

    def observe(
        self,
        seq: int,
        e: ev.ProgressReported,
        at: float,
        job: JobState | None,
        *,
        rate: bool = True,
        gpu_type: str | None = None,
    ) -> list[Reason]:
        """Fold one report; returns the reasons for whatever part of it was not used.

        Args:
            seq: Stream sequence of the report.
            e: The report.
            at: Its occurred-at.
            job: The job's folded state (``None`` when unknown).
            rate: False: fold only the report's loss, not its rate (a report made
                before the job had run a whole measurement window at its GPU count,
                AFS §4.5; see the profiler service).
            gpu_type: The generation the report was made on, when the caller knows
                better than the report and the job's current one (a move to another
                generation not yet completed; see the profiler service).

        Returns:
            Rejection reasons (empty when the whole report was used).
        """
        if job is None:
            return [self._reject(Reason.UNKNOWN_JOB)]
        if job.status in FINISHED_STATUSES:
            return [self._reject(Reason.FINISHED_JOB)]
        reasons: list[Reason] = []
        rate_reason = self._observe_rate(seq, e, at, job, gpu_type) if rate else None
        if rate_reason is not None:
            reasons.append(self._reject(rate_reason))
        if e.loss is not None:
            loss_reason = self._observe_loss(seq, e)
            if loss_reason is not None:
                reasons.append(self._reject(loss_reason))
        return reasons

    def _observe_rate(
        self, seq: int, e: ev.ProgressReported, at: float, job: JobState, where: str | None = None
    ) -> Reason | None:
        p = self.params
        gpu_type = e.gpu_type or (where if where is not None else job.gpu_type) or ""
        gpus = e.num_gpus or job.world_size or job.gpus
        prev = self.last.get(e.job_id)
        if gpus > 0:
            self.last[e.job_id] = _Last(
                iteration=e.iteration, at=at, epoch=e.epoch, num_gpus=gpus, gpu_type=gpu_type
            )
        if gpus <= 0:
            return Reason.NO_GPUS
        if gpus > job.spec.max_gpus:
            return Reason.GPUS_OVER_MAX
        rate: float | None = None
        for value, unit in ((e.step_time_s, None), (e.samples_per_s, job.spec.global_batch_size)):
            if not isinstance(value, int | float):
                return Reason.NONFINITE_RATE
            if math.isnan(value) or math.isinf(value):
                return Reason.NONFINITE_RATE
            if value < 0:
                return Reason.NEGATIVE_RATE
            if value > 0 and rate is None:
                rate = 1.0 / value if unit is None else value / max(1, unit)
        if rate is None and prev is not None:
            same = (prev.epoch, prev.num_gpus, prev.gpu_type) == (e.epoch, gpus, gpu_type)
            if same and at > prev.at and e.iteration > prev.iteration:
                rate = (e.iteration - prev.iteration) / (at - prev.at)
        if rate is None:
            return Reason.NO_RATE
        if not math.isfinite(rate):
            return Reason.NONFINITE_RATE
        if rate > p.max_rate:
            return Reason.IMPLAUSIBLE_RATE
        by_count = self.rates.setdefault(e.job_id, {}).setdefault(gpu_type, {})
        by_count[gpus] = record_sample(
            by_count.get(gpus, []),
            rate,
            window=p.window,
            change_threshold=p.change_threshold,
            confirm=p.confirm,
        )
        self.basis[(e.job_id, gpu_type)] = seq
        self.dirty_models.add((e.job_id, gpu_type))
        return None

    def _observe_loss(self, seq: int, e: ev.ProgressReported) -> Reason | None:
        loss = e.loss
        if loss is None:
            return None
        if not isinstance(loss, int | float) or math.isnan(loss) or math.isinf(loss):
            return Reason.NONFINITE_LOSS
        if loss < 0:
            return Reason.NEGATIVE_LOSS
        points = self.losses.setdefault(e.job_id, [])
        points.append((e.iteration, float(loss)))
        if len(points) > self.params.loss_points:
            # Merge the oldest half pairwise (Optimus averages the points of long jobs).
            n = (len(points) // 2) // 2 * 2
            merged = [
                ((points[i][0] + points[i + 1][0]) // 2, (points[i][1] + points[i + 1][1]) / 2.0)
                for i in range(0, n, 2)
            ]
            self.losses[e.job_id] = merged + points[n:]
        starts = self.epoch_starts.setdefault(e.job_id, {})
        starts.setdefault(e.data_epoch, e.iteration)
        self.loss_basis[e.job_id] = seq
        self.dirty_convergence.add(e.job_id)
        return None

    def measured(self, job_id: str, gpu_type: str) -> dict[int, float]:
        """GPU count -> average of the recent samples, for one job on one GPU type."""
        out: dict[int, float] = {}
        for count, samples in self.rates.get(job_id, {}).get(gpu_type, {}).items():
            r = profiled_rate(samples)
            if r is not None:
                out[count] = r
        return out

    def samples(self, job_id: str, gpu_type: str) -> int:
        return sum(len(s) for s in self.rates.get(job_id, {}).get(gpu_type, {}).values())

    def steps_per_epoch(self, job_id: str) -> float | None:
        """Mean iterations per data epoch over the complete epochs seen (None: fewer than one)."""
        starts = self.epoch_starts.get(job_id, {})
        epochs = sorted(starts)
        if len(epochs) < 2 or epochs[-1] == epochs[0]:
            return None
        span = starts[epochs[-1]] - starts[epochs[0]]
        return span / (epochs[-1] - epochs[0]) if span > 0 else None


def throughput_update(
    book: ProfileBook, job_id: str, gpu_type: str, job: JobState
) -> ev.ThroughputModelUpdated | None:
    """The model the book supports for one job on one GPU type (None: no measurement).

    Args:
        book: The measurements.
        job_id: The job.
        gpu_type: The GPU generation (``""`` on a homogeneous cluster).
        job: The job's folded state (for ``max_gpus`` and the global batch).

    Returns:
        The candidate ``ThroughputModelUpdated`` (see the module docstring).
    """
    p = book.params
    measured = book.measured(job_id, gpu_type)
    if not measured:
        return None
    max_gpus = job.spec.max_gpus
    upto = min(max_gpus, p.publish_max_counts)
    kind = OVERESTIMATE_KIND
    params: tuple[float, ...] = ()
    curve = estimate_curve(measured, upto)
    overestimated = is_overestimated(measured, max_gpus)
    table = job.spec.profile.get(gpu_type) or job.spec.profile.get("")
    if table and overestimated:
        try:
            reference = interpolate(table, upto=upto)
        except ValueError:
            reference = None
        if reference is not None:
            kind = PROFILE_KIND
            curve = calibrate_reference(measured, reference, upto)
            overestimated = False
    elif len(measured) >= p.fit_min_counts:
        from shoal.profiling.speed import fit_speed

        fit = fit_speed(measured, global_batch=float(job.spec.global_batch_size))
        if fit.rel_error <= p.fit_max_error:
            kind = MODEL_KIND
            params = fit.theta
            curve = tuple(measured.get(k, fit.throughput(k)) if k else 0.0 for k in range(upto + 1))
            overestimated = False
    return ev.ThroughputModelUpdated(
        job_id=job_id,
        gpu_type=gpu_type,
        model_kind=kind,
        params=params,
        throughput={k: float(curve[k]) for k in range(1, upto + 1)},
        samples=book.samples(job_id, gpu_type),
        overestimated=overestimated,
        measured=tuple(sorted(k for k in measured if k <= upto)),
    )


def convergence_update(
    book: ProfileBook, job_id: str, job: JobState
) -> ev.ConvergenceEstimated | Reason | None:
    """The convergence estimate the book supports for one job.

    Returns:
        The candidate event; :attr:`Reason.TARGET_UNREACHABLE` when the fit says the
        job never reaches its target; ``None`` when there is nothing to estimate
        (too few points, no target and no plateau rule, or a known length).
    """
    p = book.params
    points = book.losses.get(job_id, [])
    spec = job.spec
    if spec.total_iterations is not None:
        return None
    if len({k for k, _ in points}) < p.convergence_min_points:
        return None
    from shoal.profiling.convergence import fit_convergence

    try:
        model = fit_convergence(points)
    except ValueError:
        return None
    total: float | None
    if spec.convergence_target is not None:
        total = model.iterations_to_loss(spec.convergence_target)
    elif p.plateau_delta is not None:
        k_epoch = book.steps_per_epoch(job_id)
        if k_epoch is None:
            return None
        scale = max(loss for _, loss in points)
        total = model.iterations_to_plateau(p.plateau_delta * scale, k_epoch)
    else:
        return None
    if total is None or not math.isfinite(total):
        return Reason.TARGET_UNREACHABLE
    return ev.ConvergenceEstimated(
        job_id=job_id,
        beta0=model.beta0,
        beta1=model.beta1,
        beta2=model.beta2,
        estimated_total_iterations=max(math.ceil(total), job.iteration),
        samples=model.samples,
    )


def __getattr__(name: str) -> Any:
    if name == "ConvergenceModel":  # re-exported, imported on first use (numpy)
        from shoal.profiling.convergence import ConvergenceModel

        return ConvergenceModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "OVERESTIMATE_KIND",
    "PROFILER_KINDS",
    "PROFILE_KIND",
    "ConvergenceModel",
    "ProfileBook",
    "ProfileParams",
    "Reason",
    "convergence_update",
    "throughput_update",
]

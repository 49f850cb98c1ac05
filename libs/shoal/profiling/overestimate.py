"""AFS/CoDDL §4.5: *overestimate first, re-adjust later* — pure.

The paper (CoDDL §4.5, "Throughput Measurement"): a new job's initial share is
chosen "by assuming the linear throughput scalability" (within its fair share
1/n). Once it runs, "it takes the throughput measurement with all allocatable
units that are smaller than the given share" (shrinking costs milliseconds, and
the measuring iterations are training iterations), and "in a rare case where a
job needs to predict the throughput beyond the currently allocated share, it
assumes the linear scalability from the last allocatable unit. Then, the
re-adjustment is made again when the real throughputs are reported".

The exact rule of :func:`estimate_curve` (iterations/s at index ``k = 0..max_gpus``):

1. ``k = 0`` is ``0.0``.
2. A measured count keeps its measured value (measurement always wins).
3. An unmeasured count ``k`` assumes linear scalability from an *anchor* ``a``:
   ``T(k) = T(a) · k / a``, where ``a`` is the largest measured count below ``k``
   (§4.5's "last allocatable unit"), or, when no count below ``k`` was measured,
   the smallest measured count (linear through the origin, the same assumption a
   new job starts with).
4. Non-decreasing cap: an unmeasured ``k`` is never given more than a measured
   ``T(b)`` at a larger count ``b > k``. Otherwise a gap between two
   measurements (``T(1)=1, T(4)=2`` → linear ``T(3)=3``) would claim that three
   GPUs beat a measured four; with the cap the estimate stays optimistic about
   every count that can still be measured, never about one that was.
5. No measurement at all: linear scaling in *relative* units, ``T(k) = k``
   (what the allocator must assume for a job that has not run yet; it is not a
   measurement, so the profiler never publishes it as a model).

Why this is an *over*-estimate: data-parallel jobs with a fixed global batch have
non-increasing per-GPU throughput, so linear scaling from the nearest measured
count below ``k`` is the tightest linear upper bound the measurements allow. It
over-states the marginal gain of unmeasured GPUs, so the allocator errs towards
giving GPUs (cheap to take back, §4.3) and measures; under-stating would never
be corrected because the job would never be given the GPUs to measure them.
Below the smallest measured count ``m``, ``T(m)·k/m`` under-states ``T(k)`` but
over-states the gain ``T(m) − T(k)`` of the GPUs between ``k`` and ``m`` — the
quantity a share decision compares (AFS eq. (3)) — so the job keeps its GPUs
until §4.5 measures those smaller counts, which it does next.

:func:`measurement_plan` is what to measure next: the allocatable units not
larger than the current share that have no measurement yet, largest first (the
job first runs with its share, then shrinks through the smaller units).
:func:`allocatable_units` lists the counts network packing allows (AFS appendix
E: 1, 2, 4 … up to a node, then whole nodes).

Where it runs. :func:`decide_overestimate_first` is the allocation step of §4.5,
called by the simulator (``SimConfig.profiling="overestimate"``) and by the allocator
service on every decision, with :func:`shoal.view.estimated_jobs` of the folded log
saying which jobs are on the estimate and which counts are measured:

* :func:`first_share_view` caps a new job (nothing measured, no known curve) at the
  fair share :func:`fair_share` ``= max(1, ⌊M/n⌋)``, n the active jobs;
* :func:`probe_shares` takes a job measured at its share through the unmeasured
  allocatable units below it, one decision per measurement, then lets the policy
  re-adjust it.

Measurements come from the profiler (``shoal.profiling.throughput_update``: one per
newly measured count, once the job has run ``profiler_min_interval_s`` at that count
since its reconfiguration completed, see ``services/profiler/service.py``) or, in the
simulator, once the job has run ``SimConfig.measure_s`` (the same interval by
default) at a count. ``benchmarks/conformance.py``'s ``overestimate`` cases run both
and compare them (``benchmarks/reports/conformance_overestimate.md``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.policies.base import ClusterView, feasible_counts

if TYPE_CHECKING:
    from shoal.events import SharesDecided
    from shoal.policies.base import Policy


def _clean(measured: Mapping[int, float]) -> dict[int, float]:
    """Positive, finite measurements at positive counts only."""
    return {
        int(k): float(v)
        for k, v in measured.items()
        if int(k) > 0 and isinstance(v, int | float) and math.isfinite(v) and v > 0
    }


def estimate_curve(measured: Mapping[int, float], max_gpus: int) -> tuple[float, ...]:
    """The optimistic throughput curve of §4.5 (see the module docstring for the rule).

    Args:
        measured: GPU count -> measured iterations/s. Non-positive, NaN or
            infinite values and non-positive counts are ignored (not measured).
            Counts above ``max_gpus`` still anchor the estimate.
        max_gpus: Last index of the curve (the job's largest GPU count).

    Returns:
        Iterations/s at index ``k = 0..max_gpus``; index 0 is ``0.0``.

    Raises:
        ValueError: ``max_gpus`` is negative.
    """
    if max_gpus < 0:
        raise ValueError(f"max_gpus must be >= 0, got {max_gpus}")
    points = _clean(measured)
    if not points:
        return tuple(float(k) for k in range(max_gpus + 1))
    counts = sorted(points)
    # suffix_min[i] = smallest measured value at counts[i:], for the non-decreasing cap.
    suffix_min = [math.inf] * (len(counts) + 1)
    for i in range(len(counts) - 1, -1, -1):
        suffix_min[i] = min(points[counts[i]], suffix_min[i + 1])
    out = [0.0] * (max_gpus + 1)
    for k in range(1, max_gpus + 1):
        if k in points:
            out[k] = points[k]
            continue
        i = bisect.bisect_right(counts, k)  # counts[:i] <= k < counts[i:]
        a = counts[i - 1] if i > 0 else counts[0]
        out[k] = min(points[a] * k / a, suffix_min[i])
    return tuple(out)


def calibrate_reference(
    measured: Mapping[int, float], reference: Sequence[float], max_gpus: int
) -> tuple[float, ...]:
    """A known curve's *shape*, re-adjusted to the measurements (§4.5's re-adjust step).

    When the job comes with a reference curve (an offline profile, a trace's
    calibrated curve), its shape is better information than linear scaling. Each
    unmeasured count ``k`` takes ``reference[k] · T(a) / reference[a]`` with the
    same anchor ``a`` as :func:`estimate_curve`; measured counts keep their value.

    Args:
        measured: GPU count -> measured iterations/s (nonsense ignored).
        reference: Iterations/s at index ``0..`` (index 0 unused); its last value
            repeats beyond its end.
        max_gpus: Last index of the result.

    Returns:
        Iterations/s at index ``0..max_gpus``; :func:`estimate_curve` when there is
        no usable reference value at an anchor.
    """
    points = _clean(measured)
    ref = [float(v) for v in reference]
    if not points or len(ref) < 2:
        return estimate_curve(measured, max_gpus)

    def at(k: int) -> float:
        return ref[min(k, len(ref) - 1)]

    counts = sorted(points)
    if any(not (math.isfinite(at(c)) and at(c) > 0) for c in counts):
        return estimate_curve(measured, max_gpus)
    out = [0.0] * (max_gpus + 1)
    for k in range(1, max_gpus + 1):
        if k in points:
            out[k] = points[k]
            continue
        i = bisect.bisect_right(counts, k)
        a = counts[i - 1] if i > 0 else counts[0]
        value = at(k) * points[a] / at(a)
        out[k] = value if math.isfinite(value) and value > 0 else points[a] * k / a
    return tuple(out)


def is_overestimated(
    measured: Mapping[int, float], max_gpus: int, units: Iterable[int] | None = None
) -> bool:
    """True while some count the job may be given has no measurement yet.

    Args:
        measured: GPU count -> measured iterations/s.
        max_gpus: The job's largest GPU count.
        units: The counts that matter (default: every count ``1..max_gpus``).

    Returns:
        Whether any of those counts is estimated rather than measured.
    """
    points = _clean(measured)
    wanted = range(1, max_gpus + 1) if units is None else (u for u in units if 0 < u <= max_gpus)
    return any(u not in points for u in wanted)


def allocatable_units(max_gpus: int, gpus_per_node: int = 0) -> tuple[int, ...]:
    """GPU counts a network-packed share can take (AFS appendix E).

    Powers of two up to a node's size, then multiples of the node size; with
    ``gpus_per_node == 0`` (a flat pool) powers of two. ``max_gpus`` itself is
    always included (a job's largest share).

    Args:
        max_gpus: The job's largest GPU count.
        gpus_per_node: GPUs per server, 0 for a flat pool.

    Returns:
        Increasing counts, all in ``1..max_gpus``.
    """
    if max_gpus <= 0:
        return ()
    units: set[int] = set()
    p = 1
    limit = gpus_per_node if gpus_per_node > 0 else max_gpus
    while p <= min(limit, max_gpus):
        units.add(p)
        p *= 2
    if gpus_per_node > 0:
        units.update(range(gpus_per_node, max_gpus + 1, gpus_per_node))
    units.add(max_gpus)
    return tuple(sorted(units))


def measurement_plan(measured: Mapping[int, float], share: int, units: Iterable[int]) -> tuple[int, ...]:
    """§4.5: the allocatable units not above ``share`` still to be measured.

    Args:
        measured: GPU count -> measured iterations/s.
        share: The job's current share (GPUs).
        units: Allocatable counts (see :func:`allocatable_units`).

    Returns:
        Unmeasured units ``≤ share``, largest first: the job runs with its share,
        then shrinks through the smaller units (each shrink costs milliseconds).
    """
    points = _clean(measured)
    return tuple(sorted({u for u in units if 0 < u <= share and u not in points}, reverse=True))


# -- §4.5 in the allocation pipeline ------------------------------------------------
#
# ``estimates`` below maps each job whose throughput curve is the §4.5 estimate to the
# GPU counts measured so far (empty: a new job, nothing measured yet); a job absent from
# it has a known curve (an offline profile, a catalog curve, the simulator's oracle, a
# trusted fit) and is left alone. :func:`shoal.view.estimated_jobs` builds it from the
# folded state, the same way for the simulator and the allocator service.


def fair_share(total_gpus: int, n_jobs: int) -> int:
    """§4.5's fair share ``1/n`` of the cluster, in whole GPUs.

    ``n`` is the number of jobs in the system when the share is decided: every active
    job of the view (running and waiting), the new one included. The AFS paper writes
    ``n`` for the number of jobs sharing the cluster (§3.3, appendix E) and caps a new
    job's initial share "within its fair share (1/n)" (§4.5) without saying how to
    round; shoal rounds down, and never below one GPU (AFS gives every job at least one
    GPU while jobs do not outnumber GPUs, §3.3 stage one).

    Args:
        total_gpus: GPUs of the cluster (the view's ``total_gpus``).
        n_jobs: active jobs, the new one included.

    Returns:
        ``max(1, total_gpus // n_jobs)`` (``total_gpus`` when ``n_jobs <= 0``).
    """
    if n_jobs <= 0:
        return max(0, total_gpus)
    return max(1, total_gpus // n_jobs)


def first_share_view(view: ClusterView, estimates: Mapping[str, Iterable[int]]) -> ClusterView:
    """The view with each *new* elastic job's largest count capped at :func:`fair_share`.

    §4.5: "When a new job arrives, the scheduler allocates an initial share to it by
    assuming the linear throughput scalability. We limit the initial share to be within
    its fair share (1/n)." A new job is one in ``estimates`` with no measured count.
    Its ``max_gpus`` (and ``requested_gpus``, for an elastic job only a hint) become the
    largest feasible count not above the fair share, or its smallest feasible count when
    none is (a ``min_gpus`` above the fair share wins). Rigid jobs are not capped: they
    run at their request or not at all. The policy then decides on the capped view, so
    GPUs the cap keeps from the new job go to the others by the policy's own rule.

    Args:
        view: the view the policy would decide on.
        estimates: job id -> measured GPU counts, for the jobs on the §4.5 estimate.

    Returns:
        ``view`` itself when no job is capped, else a copy with the capped jobs.
    """
    new = {j for j, counts in estimates.items() if not tuple(counts)}
    if not new:
        return view
    cap = fair_share(view.total_gpus, len(view.jobs))
    jobs = []
    changed = False
    for job in view.jobs:
        if job.job_id not in new or not job.elastic or job.max_gpus <= cap:
            jobs.append(job)
            continue
        feasible = feasible_counts(job)
        below = [c for c in feasible if c <= cap]
        top = below[-1] if below else (feasible[0] if feasible else job.max_gpus)
        if top >= job.max_gpus:
            jobs.append(job)
            continue
        jobs.append(msgspec.structs.replace(job, max_gpus=top, requested_gpus=min(job.requested_gpus, top)))
        changed = True
    return msgspec.structs.replace(view, jobs=tuple(jobs)) if changed else view


def probe_shares(
    view: ClusterView, shares: Mapping[str, int], estimates: Mapping[str, Iterable[int]]
) -> dict[str, int]:
    """§4.5's measurement step: shares with each job under measurement at its next unit.

    "When the job gets its GPU share, it takes the throughput measurement with all
    allocatable units that are smaller than the given share." The given share of a job
    in ``estimates`` is its largest measured count ``m`` (it runs at its share first and
    is measured there, then goes down). While some allocatable unit below ``m`` is
    unmeasured (:func:`measurement_plan` over :func:`allocatable_units` for the view's
    server size, restricted to the job's feasible counts), the job is given the largest
    such unit ``u`` — or the policy's share when that is smaller, and nothing when the
    policy gave it nothing — whatever the policy decided on the estimate. A job with no
    measurement keeps the policy's share (it is measured there first). Once no unit is
    left the policy's share stands: the re-adjustment on the measured curve, which past
    ``m`` still assumes linear scaling from the last allocatable unit
    (:func:`estimate_curve`); a larger share is then measured, and the units between
    ``m`` and it in turn.

    The GPUs between ``u`` and the policy's share stay idle for that measurement
    (choice: the paper shrinks the job's share and says nothing of lending them, and
    lending them would reconfigure other jobs twice per probe). Each published
    measurement makes the allocator decide again (``model_update``), which moves the
    job to its next unit.

    Args:
        view: the view the decision was made on (node size, each job's counts).
        shares: the decided shares (job id -> GPUs).
        estimates: job id -> measured GPU counts, for the jobs on the §4.5 estimate.

    Returns:
        The shares to publish (a new dict; unchanged jobs keep their share).
    """
    out = dict(shares)
    if not estimates:
        return out
    for job in view.jobs:
        counts = estimates.get(job.job_id)
        share = out.get(job.job_id, 0)
        if counts is None or share <= 0:
            continue
        measured = {int(k): 1.0 for k in counts if int(k) > 0}
        if not measured:
            continue
        feasible = set(feasible_counts(job))
        units = [u for u in allocatable_units(job.max_gpus, view.gpus_per_node) if u in feasible]
        plan = measurement_plan(measured, max(measured), units)
        if plan:
            out[job.job_id] = min(share, plan[0])
    return out


def decide_overestimate_first(
    policy: Policy,
    view: ClusterView,
    memory: Mapping[str, Any],
    *,
    estimates: Mapping[str, Iterable[int]] | None,
    epoch: int,
    trigger: str = "",
    network_packing: bool = True,
) -> SharesDecided:
    """:func:`shoal.allocation.decide_shares` with §4.5 around it, for the simulator and
    the allocator service alike.

    The policy decides on :func:`first_share_view` (new jobs capped at ``1/n``); the
    decided (and network-packed) shares then pass through :func:`probe_shares`. With
    ``estimates`` empty or ``None``, or a policy that is not elastic
    (:func:`~shoal.policies.base.policy_is_elastic`: FIFO, SRTF, SRSF, Tiresias-L,
    Gandiva_fair), this is ``decide_shares`` itself: §4.5
    resizes a job to measure it, and such a policy runs every job at the size it
    decided or not at all. Its jobs are measured at the sizes they run at.

    Returns:
        The ``SharesDecided`` event to publish (positive shares only, sorted by job id).
    """
    from shoal.allocation import decide_shares
    from shoal.policies.base import policy_is_elastic

    if not estimates or not policy_is_elastic(policy):
        return decide_shares(
            policy, view, memory, epoch=epoch, trigger=trigger, network_packing=network_packing
        )
    capped = first_share_view(view, estimates)
    decided = decide_shares(
        policy, capped, memory, epoch=epoch, trigger=trigger, network_packing=network_packing
    )
    probed = probe_shares(capped, decided.shares, estimates)
    if probed == decided.shares:
        return decided
    return msgspec.structs.replace(decided, shares={j: s for j, s in sorted(probed.items()) if s > 0})

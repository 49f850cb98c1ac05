"""Tiresias-L: discretized two-dimensional least-attained-service (Tiresias, NSDI'19).

The Tiresias paper itself is not in ``shared/papers``; the algorithm is as EDL §5.1
summarises it and as AFS/CoDDL §5.1 configured it as a baseline.

Tiresias-L is length-unaware: a job's priority is its attained service in GPU-seconds
(the "2D" of 2D-LAS: GPUs × time), discretized into ``K`` queues ``Q0 … Q(K-1)``
split at ``queue_thresholds_gpu_s``. Queues are served strictly in order; inside a
queue jobs are served first-come-first-served. A job runs with its requested GPUs or
not at all (Tiresias is not elastic), and the scan goes on past a job that does not
fit (backfill). A running job that falls out of the plan is preempted.

Defaults follow how AFS/CoDDL configured its Tiresias-L baseline (AFS §5.1; the
authors' simulator, see REPRODUCTION.md "Tiresias-L"):

* **Two queues split at 50 GPU-hours** (``queue_thresholds_gpu_s=(180000.0,)``).
  Pass more thresholds for more queues (EDL's evaluation uses ``(500.0, 10000.0)``,
  see :mod:`shoal.policies.elastic_tiresias`).
* **Service counted since the job's last restart** (``service_since_restart=True``):
  a preempted job that is started again re-enters ``Q0``. With ``False`` the count is
  the job's whole attained service, as in the Tiresias paper.
* **No starvation rule** (``promote_knob=None``). With a number ``k``, a preempted job
  in ``Q1`` or lower whose wait since its preemption reaches ``k`` × its run time since
  it last entered ``Q0`` is promoted back to ``Q0`` (Tiresias' "PROMOTEKNOB"; EDL §5.1:
  "If a job is not scheduled for a long time, it will be moved to G_0").
* FCFS inside a queue is by the time the job was first started, then by arrival (jobs
  that have run before go first, as in the AFS simulator), then by job id.

Choices where the interface leaves room:

* A job's gang size is ``requested_gpus`` when it is a feasible count, else the largest
  feasible count below it, else the smallest feasible count (:func:`gang_size`).
* Demotion happens at a decision: the policy asks to be re-run when the next running
  job crosses its queue's threshold (``memory["next_decision_at_s"]``), and when the
  next promotion falls due.

Memory (msgpack-able): ``jobs`` maps an active job id to ``[base_service_gpu_s,
first_start_s, stopped_at_s]`` (``-1`` for "never"/"running"); ``base`` is the
attained service at the job's last restart (or promotion), so the service that counts
is ``attained_service_gpu_s - base``. A job whose record is ``[0, -1, -1]`` (one that
never started) is left out; finished jobs are dropped. The policy never reads
``remaining_iterations``.

Cost of a decision in a long queue (:meth:`TiresiasL.decide`, no promotion): most of a
long queue is jobs that never ran, no record, no attained service, no GPUs. Their key
is ``(Q0, never, arrival, id)``: they are already in order in the view (arrival order),
so they are walked lazily, and only as far as the GPUs go, merged with the few others
(recorded, served or running; found with C-level passes over the view), which are
sorted. The earlier form built, sorted and wrote back a record for every job at every
decision. :meth:`TiresiasL.decide_all` keeps that form, and a property test checks both
decide alike; with a ``promote_knob`` every waiting job's wait counts, so that form runs.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts, jobs_by_id
from shoal.policies.common import view_arrival_order

NEVER = -1.0
_ATTAINED = operator.attrgetter("attained_service_gpu_s")
_CURRENT = operator.attrgetter("current_gpus")
_JOB_ID = operator.attrgetter("job_id")


def gang_size(job: JobView) -> int:
    """The GPUs a non-elastic scheduler gives a job: its request when feasible.

    Falls back to the largest feasible count below the request, else the smallest
    feasible count; 0 when the job has no feasible count.
    """
    counts = feasible_counts(job)
    if not counts:
        return 0
    if job.requested_gpus in counts:
        return job.requested_gpus
    below = [c for c in counts if c <= job.requested_gpus]
    return below[-1] if below else counts[0]


class JobRecord:
    """Tiresias bookkeeping of one job, rebuilt from and written back to memory."""

    __slots__ = ("base", "first_start", "job", "queue", "service", "stopped_at")

    def __init__(self, job: JobView, raw: Sequence[float] | None) -> None:
        self.job = job
        if raw is None or len(raw) < 3:
            self.base, self.first_start, self.stopped_at = 0.0, NEVER, NEVER
        else:
            self.base, self.first_start, self.stopped_at = float(raw[0]), float(raw[1]), float(raw[2])
        self.service = 0.0
        self.queue = 0

    def dump(self) -> list[float]:
        return [self.base, self.first_start, self.stopped_at]

    def is_default(self) -> bool:
        """The record of a job that never started (left out of memory)."""
        return self.base == 0.0 and self.first_start == NEVER and self.stopped_at == NEVER

    def order_key(self) -> tuple[int, float, float, str]:
        first = self.first_start if self.first_start >= 0 else float("inf")
        return (self.queue, first, self.job.arrival_s, self.job.job_id)


def _stored(memory: Mapping[str, Any]) -> Mapping[str, Any]:
    stored = memory.get("jobs", {})
    return stored if isinstance(stored, Mapping) else {}


def _record(job: JobView, raw: Sequence[float] | None, thresholds: Sequence[float]) -> JobRecord:
    """A job's record with its service since ``base`` and its queue (no promotion)."""
    rec = JobRecord(job, raw)
    rec.service = max(0.0, job.attained_service_gpu_s - rec.base)
    rec.queue = bisect.bisect_right(thresholds, rec.service)
    return rec


def las_records(
    view: ClusterView,
    memory: Mapping[str, Any],
    thresholds: Sequence[float],
    promote_knob: float | None,
) -> list[JobRecord]:
    """Every active job with its queue, in Tiresias priority order (EDL §5.1).

    Applies promotion (when ``promote_knob`` is set) to the records' ``base``.
    """
    stored = _stored(memory)
    now = view.now_s
    records = []
    for job in view.jobs:
        rec = _record(job, stored.get(job.job_id), thresholds)
        if (
            promote_knob is not None
            and rec.queue > 0
            and job.current_gpus == 0
            and rec.stopped_at >= 0
            and now - rec.stopped_at >= promote_knob * rec.service / max(1, gang_size(job))
        ):
            # Tiresias' starvation avoidance (EDL §5.1): back to Q0 with a fresh count.
            rec.base = job.attained_service_gpu_s
            rec.service = 0.0
            rec.queue = 0
        records.append(rec)
    records.sort(key=JobRecord.order_key)
    return records


def las_memory(
    view: ClusterView,
    records: Sequence[JobRecord],
    shares: Mapping[str, int],
    thresholds: Sequence[float],
    *,
    service_since_restart: bool,
    promote_knob: float | None,
) -> dict[str, Any]:
    """Memory after a decision: restarts reset the count, preemptions start the wait clock.

    Also asks for a re-run at the next demotion or promotion. ``records`` must hold
    every job that holds or is given GPUs and every job with a record in memory; the
    others are left out of the memory (they never started).
    """
    now = view.now_s
    wake = float("inf")
    jobs: dict[str, list[float]] = {}
    for rec in records:
        job = rec.job
        gpus = shares.get(job.job_id, 0)
        if gpus and not job.current_gpus:
            if service_since_restart:
                rec.base = job.attained_service_gpu_s
                rec.service = 0.0
                rec.queue = 0
            if rec.first_start < 0:
                rec.first_start = now
            rec.stopped_at = NEVER
        elif not gpus and (job.current_gpus or (rec.stopped_at < 0 and rec.first_start >= 0)):
            # Preempted now (or started last time but never placed): the wait starts.
            rec.stopped_at = now
        if gpus and rec.queue < len(thresholds):
            wake = min(wake, now + (thresholds[rec.queue] - rec.service) / gpus)
        elif not gpus and promote_knob is not None and rec.queue > 0 and rec.stopped_at >= 0:
            due = rec.stopped_at + promote_knob * rec.service / max(1, gang_size(job))
            wake = min(wake, max(due, now))
        if not rec.is_default():
            jobs[job.job_id] = rec.dump()
    memory: dict[str, Any] = {"jobs": jobs}
    if wake != float("inf"):
        memory["next_decision_at_s"] = wake
    return memory


class TiresiasL:
    """Tiresias-L (2D-LAS, discretized), non-elastic, length-unaware."""

    name = "tiresias-l"
    elastic = False
    """All-or-nothing: each share is the job's gang size, never regulated (:attr:`shoal.policies.base.Policy.elastic`)."""

    def __init__(
        self,
        *,
        queue_thresholds_gpu_s: Sequence[float] = (180_000.0,),
        service_since_restart: bool = True,
        promote_knob: float | None = None,
    ) -> None:
        """Configure the policy.

        Args:
            queue_thresholds_gpu_s: Increasing service thresholds (GPU-seconds) between
                consecutive queues; ``K - 1`` values for ``K`` queues. Default: two
                queues split at 50 GPU-hours (AFS §5.1).
            service_since_restart: Count service since the job's last restart, so a
                restarted job re-enters ``Q0`` (AFS); ``False`` counts all service.
            promote_knob: Tiresias' starvation knob (``None``: no promotion).

        Raises:
            ValueError: thresholds not positive and strictly increasing, or a negative knob.
        """
        thresholds = tuple(float(t) for t in queue_thresholds_gpu_s)
        if any(t <= 0 for t in thresholds) or any(b <= a for a, b in itertools.pairwise(thresholds)):
            raise ValueError(f"queue thresholds must be positive and increasing, got {thresholds}")
        if promote_knob is not None and promote_knob < 0:
            raise ValueError(f"promote_knob must be non-negative, got {promote_knob}")
        self.queue_thresholds_gpu_s = thresholds
        self.service_since_restart = service_since_restart
        self.promote_knob = promote_knob

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """One Tiresias plan: strict queue order, FCFS inside, requested GPUs, backfill.

        The jobs that never ran are walked lazily, in arrival order, only as far as the
        GPUs go (see the module docstring); the decision is :meth:`decide_all`'s.
        """
        if self.promote_knob is not None:
            return self.decide_all(view, memory)
        thresholds = self.queue_thresholds_gpu_s
        stored = _stored(memory)
        index = jobs_by_id(view)
        jobs = view_arrival_order(view)
        # Every job whose key may not be (Q0, never, arrival, id) or whose record may
        # change without a start: the recorded ones, the served ones, the running ones.
        others: dict[str, JobRecord] = {}
        for job_id, raw in stored.items():
            job = index.get(job_id)
            if job is not None:
                others[job_id] = _record(job, raw, thresholds)
        for job in itertools.chain(
            itertools.compress(jobs, map(_ATTAINED, jobs)), itertools.compress(jobs, map(_CURRENT, jobs))
        ):
            if job.job_id not in others:
                others[job.job_id] = _record(job, None, thresholds)
        ordered = sorted(others.values(), key=JobRecord.order_key)
        fresh = _fresh_records(jobs, others, thresholds)
        free = view.total_gpus
        shares: dict[str, int] = {}
        started_fresh: list[JobRecord] = []
        for rec in heapq.merge(ordered, fresh, key=JobRecord.order_key):
            if free <= 0:
                break
            g = gang_size(rec.job)
            if 0 < g <= free:
                shares[rec.job.job_id] = g
                free -= g
                if rec.job.job_id not in others:
                    started_fresh.append(rec)
        new_memory = las_memory(
            view,
            ordered + started_fresh,
            shares,
            thresholds,
            service_since_restart=self.service_since_restart,
            promote_knob=None,
        )
        return Decision(shares=shares, memory=new_memory)

    def decide_all(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """:meth:`decide` with a record for every job, all sorted (the reference form;
        the one that runs with a ``promote_knob``)."""
        records = las_records(view, memory, self.queue_thresholds_gpu_s, self.promote_knob)
        free = view.total_gpus
        shares: dict[str, int] = {}
        for rec in records:
            if free <= 0:
                break
            g = gang_size(rec.job)
            if 0 < g <= free:
                shares[rec.job.job_id] = g
                free -= g
        new_memory = las_memory(
            view,
            records,
            shares,
            self.queue_thresholds_gpu_s,
            service_since_restart=self.service_since_restart,
            promote_knob=self.promote_knob,
        )
        return Decision(shares=shares, memory=new_memory)


def _fresh_records(
    jobs: Sequence[JobView], others: Mapping[str, JobRecord], thresholds: Sequence[float]
) -> Iterator[JobRecord]:
    """The jobs not in ``others`` (no record, no service, no GPUs), in arrival order, as
    records: their key is ``(0, never, arrival, id)``, so this is their Tiresias order."""
    unrecorded = map(operator.not_, map(others.__contains__, map(_JOB_ID, jobs)))
    for job in itertools.compress(jobs, unrecorded):
        yield _record(job, None, thresholds)

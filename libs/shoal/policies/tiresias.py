"""Tiresias-L: discretized two-dimensional least-attained-service (Tiresias, NSDI'19).

The Tiresias paper itself is not in ``shared/papers``; the algorithm is as EDL §5.1
summarises it and as AFS/CoDDL §5.1 configured it as a baseline. The rules follow the
Tiresias authors' simulator (GitHub ``SymbioticLab/Tiresias``, ``simulator/run_sim.py``,
``dlas_sim_jobs`` run with ``gputime=True``: the ``dlas-gpu`` schedule), the one
deliberate difference being where the service that picks the queue starts counting.

Tiresias-L is length-unaware: a job's priority is its attained service in GPU-seconds
(the "2D" of 2D-LAS: GPUs × time), discretized into ``K`` queues ``Q0 … Q(K-1)``
split at ``queue_thresholds_gpu_s``. A job runs with its requested GPUs or not at all
(Tiresias is not elastic). Each queue is an ordered list, kept in the policy's memory;
rule by rule, as the reference does it:

* **Arrival**: a new job is appended to the back of ``Q0`` (the reference's
  ``JOBS.queues[0].append`` for each ``start_jobs`` of an event); jobs arriving together
  in arrival order (``arrival_s``, then job id; the reference takes the trace's order).
* **Demotion** at the instant the service crosses the queue's threshold: the policy
  asks to be re-run then (``memory["next_decision_at_s"]``, the reference's
  ``next_job_jump`` event), and a job whose service has reached the threshold is
  removed from its queue and appended to the back of the next one (the reference's
  demotion check, done for each job in its ``runnable_jobs`` order, which is arrival
  order; here a job that crossed several thresholds at once goes straight to its
  queue). The reference computes the jump instant from the executed *seconds*
  (``queue_limit - executed_time``, integer-divided by the GPU count) although the
  threshold is in GPU-seconds, so for a multi-GPU job that saw another event since it
  started, its jump comes late and it is demoted at the first event after the true
  crossing; shoal re-runs at the crossing (the simulator rounds it up to a whole
  second, as the reference's integer times do).
* **The pass**: queues in order, each in its list order; a job whose gang fits in the
  GPUs still free gets them, and the scan goes on past a job that does not fit
  (backfill); a running job that is not given GPUs is preempted (the reference's
  ``for queue in JOBS.queues: for job in queue`` loop).
* **After the pass**, in every queue the jobs left without GPUs (waiting, just
  preempted, never started) move behind the jobs given GPUs, each group in its order
  (the reference's "sort based on the job start time" block: every ``PENDING`` job of
  the queue is removed and appended at its back, in queue order). This is why a queue
  is kept as a list rather than sorted by a key: a job demoted while running goes to
  the back of the next queue, behind the jobs waiting there, and a job that waited
  behind a job that then ran falls behind it.
* **Restart** (the deliberate difference, ``service_since_restart=True``): AFS §5.1
  configured its Tiresias-L baseline with two queues split at 50 GPU-hours of service
  counted since the job's last restart, with no starvation rule (``shared/
  REPRODUCTION.md``, "Tiresias-L"), so a restarted job re-enters the high-priority
  queue: a preempted job of ``Q1`` or lower that is given GPUs again restarts its count
  and is appended to the back of ``Q0`` when the pass starts it (a restarted job
  already in ``Q0`` keeps its place there). The reference never resets the count on a
  restart (``executed_time`` is only zeroed by a promotion); ``service_since_restart=
  False`` counts the job's whole attained service, as the reference and the Tiresias
  paper do. With the count since restart, jobs that outlast the threshold take turns:
  each restart buys a quantum in ``Q0``, and the demotion that ends it puts the job
  behind those waiting in ``Q1``; with the whole count a job restarted in the last
  queue stays ahead of the jobs waiting there until it ends or a job of a higher queue
  takes its GPUs (both shown by the hand-made traces in
  ``tests/policies/test_tiresias.py``).
* **No starvation rule** by default (``promote_knob=None``; the reference's
  ``dlas-gpu`` runs with ``solve_starvation=0``). With a number ``k``, a preempted job
  of ``Q1`` or lower whose wait since its preemption reaches ``k`` × its run time since
  it last entered ``Q0`` has its count restarted and is appended to the back of ``Q0``
  (Tiresias' "PROMOTEKNOB", the reference's promotion; EDL §5.1: "If a job is not
  scheduled for a long time, it will be moved to G_0"). The reference measures that
  wait as all the pending time since the job last entered ``Q0``; here it is the wait
  since the last preemption.

A second implementation, written apart as a list-per-queue event loop
(``benchmarks/tiresias_reference.py``), ends every job of ten Philly VCs at the same second
as this policy in shoal's flat simulator, and every job of 0e4a51 with the whole count
(``service_since_restart=False``) too (``benchmarks/reports/tiresias_reference.md``).

Defaults: **two queues split at 50 GPU-hours** (``queue_thresholds_gpu_s=(180000.0,)``,
AFS §5.1). Pass more thresholds for more queues (EDL's evaluation uses ``(500.0,
10000.0)``, see :mod:`shoal.policies.elastic_tiresias`).

Choices where the interface leaves room:

* A job's gang size is ``requested_gpus`` when it is a feasible count, else the largest
  feasible count below it, else the smallest feasible count (:func:`gang_size`).
* A job restarts when it is given GPUs while it holds none in the view
  (``current_gpus == 0``).
* A service within ``1e-6`` GPU-s of a threshold counts as having reached it (float
  sums of service must not leave a job just below its threshold at its demotion
  instant).
* A job with no place in the memory (one that never started; after a policy switch or a
  lost memory, also one that has service or GPUs) is at the back of ``Q0`` in arrival
  order. If its service has reached a threshold, the next decision appends it to the
  back of that queue (a demotion); if it holds or is given GPUs, the pass gives it a
  place at the back of its queue.

Memory (msgpack-able): ``jobs`` maps an active job id to ``[base_service_gpu_s,
first_start_s, stopped_at_s, queue, position]`` (``-1`` for "never"/"running");
``base`` is the attained service at the job's last restart (or promotion), so the
service that counts is ``attained_service_gpu_s - base``; the queue's list order is
ascending ``position`` (a job appended to a queue's back gets one more than the largest
position held). A job that never started and was never demoted has no record: such jobs
are the back of ``Q0``, in arrival order. Finished jobs are dropped. A three-number
record (memory written before queues were kept) is read as queue by service, position
0. The policy never reads ``remaining_iterations``.

Cost of a decision in a long queue (:meth:`TiresiasL.decide`, no promotion): most of a
long queue is jobs that never ran, no record, no attained service, no GPUs. Their place
is the back of ``Q0`` in arrival order, which is their order in the view, so they are
walked lazily, and only as far as the GPUs go, between the few others (recorded,
served or running; found with one tight pass over the view, and sorted) that hold a
place in ``Q0`` and those of the later queues.
The records of the recorded jobs are carried over from one decision to the next while
the memory is the one the last decision returned (only those whose view changed read
their service again), and a record is written out afresh only when one of its fields
changed.
:meth:`TiresiasL.decide_all` builds and sorts a record for every job, and a property
test checks both decide alike; with a ``promote_knob`` every waiting job's wait counts,
so that form runs.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts, jobs_by_id
from shoal.policies.common import view_arrival_order

NEVER = -1.0
UNPLACED = float("inf")
"""The position of a job with no record: the back of ``Q0``, in arrival order."""
SERVICE_EPS_GPU_S = 1e-6
"""A service this close below a threshold has reached it."""


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
    """Tiresias bookkeeping of one job, read from memory (or carried over from the last
    decision, see :meth:`TiresiasL.decide`) and written back to it."""

    __slots__ = (
        "base",
        "first_start",
        "job",
        "key",
        "level",
        "position",
        "queue",
        "saved",
        "service",
        "stopped_at",
    )

    def __init__(self, job: JobView, raw: Sequence[float] | None, thresholds: Sequence[float]) -> None:
        """The record of ``job`` from its memory entry ``raw`` (None: no record), with its
        service since ``base`` and the queue that service gives."""
        self.job = job
        self.saved: list[float] | None = None
        """What :meth:`dump` gave; every assignment to a dumped field clears it."""
        self.key: tuple[int, float, float, str] | None = None
        """What :meth:`order_key` gave; cleared when the queue, the position or the
        view changes."""
        if raw is not None and len(raw) >= 3:
            base = self.base = float(raw[0])
            self.first_start, self.stopped_at = float(raw[1]), float(raw[2])
            if len(raw) >= 5:
                self.queue, self.position = int(raw[3]), float(raw[4])
            else:  # no queue kept: the service decides it (below)
                self.queue, self.position = -1, 0.0
        else:
            base = self.base = 0.0
            self.first_start = self.stopped_at = NEVER
            self.queue, self.position = 0, UNPLACED
        service = job.attained_service_gpu_s - base
        self.service = service = service if service > 0.0 else 0.0  # max(0.0, service)
        self.level = bisect.bisect_right(thresholds, service + SERVICE_EPS_GPU_S)
        """The queue the service alone puts the job in (its queue once demotions are done)."""
        if self.queue < 0:  # a three-number record: no queue kept
            self.queue = self.level

    def see(self, job: JobView, thresholds: Sequence[float]) -> None:
        """Take ``job``'s new view: its service since :attr:`base` and the queue that gives."""
        self.job = job
        self.key = None
        service = job.attained_service_gpu_s - self.base
        self.service = service = service if service > 0.0 else 0.0
        self.level = bisect.bisect_right(thresholds, service + SERVICE_EPS_GPU_S)

    def dump(self) -> list[float]:
        saved = self.saved
        if saved is None:
            saved = self.saved = [
                self.base,
                self.first_start,
                self.stopped_at,
                float(self.queue),
                self.position,
            ]
        return saved

    def order_key(self) -> tuple[int, float, float, str]:
        key = self.key
        if key is None:
            key = self.key = (self.queue, self.position, self.job.arrival_s, self.job.job_id)
        return key


def _stored(memory: Mapping[str, Any]) -> Mapping[str, Any]:
    stored = memory.get("jobs", {})
    return stored if isinstance(stored, Mapping) else {}


_record = JobRecord
"""``_record(job, raw, thresholds)``: a job's record (:class:`JobRecord`)."""


def _next_position(records: Iterable[JobRecord]) -> float:
    """One more than the largest position held: the back of any queue."""
    return max(filter(math.isfinite, map(_POSITION, records)), default=-1.0) + 1.0


def _requeue(rec: JobRecord, position: float, now: float, promote_knob: float | None) -> float:
    """Promotion (with a knob) or demotion of one job, before the pass; returns the next
    free position. A moved job is appended to the back of its new queue."""
    job = rec.job
    queue = max(rec.queue, rec.level)
    if (
        promote_knob is not None
        and queue > 0
        and job.current_gpus == 0
        and rec.stopped_at >= 0
        and now - rec.stopped_at >= promote_knob * rec.service / max(1, gang_size(job))
    ):
        # Tiresias' starvation avoidance (EDL §5.1): back of Q0 with a fresh count.
        rec.base = job.attained_service_gpu_s
        rec.service = 0.0
        rec.level = rec.queue = 0
        rec.position = position
        rec.saved = rec.key = None
        return position + 1.0
    if queue > rec.queue:
        rec.queue = queue
        rec.position = position
        rec.saved = rec.key = None
        return position + 1.0
    return position


def las_records(
    view: ClusterView,
    memory: Mapping[str, Any],
    thresholds: Sequence[float],
    promote_knob: float | None,
) -> list[JobRecord]:
    """Every active job with its queue, in pass order (queue, then list order).

    Demotions and (with ``promote_knob``) promotions are applied first, in arrival order,
    each appending its job to the back of its new queue.
    """
    stored = _stored(memory)
    records = [_record(job, stored.get(job.job_id), thresholds) for job in view_arrival_order(view)]
    position = _next_position(records)
    now = view.now_s
    for rec in records:
        position = _requeue(rec, position, now, promote_knob)
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
    recorded: dict[str, JobRecord] | None = None,
) -> dict[str, Any]:
    """Memory after a pass: restarts, queue order, the wait clocks and the next wake-up.

    ``records`` must be in pass order (as :func:`las_records` returns them) and hold every
    job that holds or is given GPUs and every job with a record in memory; the others
    keep no record. In pass order, a restart resets the count (``service_since_restart``)
    and appends a job of a lower queue to the back of ``Q0``, and a job given GPUs or
    holding them without a place gets one at the back of its queue; then in each queue
    the jobs without GPUs move behind those with GPUs (each group keeps its order). Also
    asks for a re-run at the next demotion or promotion.

    ``recorded``, when given (empty), receives the records the memory lists (job id ->
    record, in the order of ``memory["jobs"]``; each record's fields are then its entry
    there).
    """
    now = view.now_s
    position = _next_position(records)
    # The placed jobs of each queue in pass order: those that keep their place (in the
    # order of ``records``), then those given one now (at the back of their queue, in
    # the order given). A queue where a job without GPUs is ahead of one with GPUs is
    # marked as the jobs are met in that order.
    kept: list[JobRecord] = []
    given: list[JobRecord] = []
    if recorded is None:
        recorded = {}
    waiting_in: set[int] = set()
    waiting_queue = -1  # the last queue added to waiting_in (records come by queue)
    behind: set[int] = set()
    levels = len(thresholds)
    wake = float("inf")
    for rec in records:
        job = rec.job
        job_id = job.job_id
        gpus = shares.get(job_id, 0)
        if gpus and not job.current_gpus:
            rec.saved = rec.key = None
            if service_since_restart:
                rec.base = job.attained_service_gpu_s
                rec.service = 0.0
                rec.level = 0
                if rec.queue > 0:  # re-enters Q0, at its back
                    rec.queue = 0
                    rec.position = UNPLACED
            if rec.first_start < 0:
                rec.first_start = now
            rec.stopped_at = NEVER
        elif not gpus and (job.current_gpus or (rec.stopped_at < 0 and rec.first_start >= 0)):
            # Preempted now (or started last time but never placed): the wait starts.
            rec.stopped_at = now
            rec.saved = None
        if rec.position != UNPLACED:
            kept.append(rec)
            recorded[job_id] = rec
            if not gpus:
                if rec.queue != waiting_queue:
                    waiting_queue = rec.queue
                    waiting_in.add(waiting_queue)
            elif rec.queue in waiting_in:
                behind.add(rec.queue)
        elif gpus or job.current_gpus:
            rec.position = position
            rec.saved = rec.key = None
            position += 1.0
            given.append(rec)
            recorded[job_id] = rec
        # The next wake-up: a demotion of a running job, a promotion of a waiting one.
        if gpus and rec.queue < levels:
            left = thresholds[rec.queue] - rec.service
            due = now + (left if left > 0.0 else 0.0) / gpus
            if due < wake:
                wake = due
        elif not gpus and promote_knob is not None and rec.queue > 0 and rec.stopped_at >= 0:
            due = rec.stopped_at + promote_knob * rec.service / max(1, gang_size(job))
            wake = min(wake, max(due, now))
    for rec in given:
        if not shares.get(rec.job.job_id):
            waiting_in.add(rec.queue)
        elif rec.queue in waiting_in:
            behind.add(rec.queue)
    for queue in sorted(behind):
        # A job without GPUs ahead of one with GPUs: every waiting job goes behind.
        for rec in itertools.chain(kept, given):
            if rec.queue == queue and not shares.get(rec.job.job_id):
                rec.position = position
                rec.saved = rec.key = None
                position += 1.0
    memory: dict[str, Any] = {
        "jobs": dict(zip(recorded, map(JobRecord.dump, recorded.values()), strict=True))
    }
    if wake != float("inf"):
        memory["next_decision_at_s"] = wake
    return memory


def _pass(jobs: Iterable[JobView], total_gpus: int) -> dict[str, int]:
    """The Tiresias pass: in order, a job whose gang fits the free GPUs gets it (backfill)."""
    free = total_gpus
    shares: dict[str, int] = {}
    for job in jobs:
        if free <= 0:
            break
        g = gang_size_by_shape(job)
        if 0 < g <= free:
            shares[job.job_id] = g
            free -= g
    return shares


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
        self._memo: tuple[Mapping[str, Any], dict[str, JobRecord], int] | None = None
        """``(memory["jobs"], records, serial)`` of the last :meth:`decide`: its records are
        that mapping's entries (:func:`las_memory`'s ``recorded``), taken by the next decide whose
        memory lists the same (see :meth:`decide`), and the serial of its jobs
        (:attr:`shoal.policies.base.LiveJobs.serial`; 0: not a simulator's)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """One Tiresias pass: queues in order, list order inside, requested GPUs, backfill.

        The jobs that never ran are walked lazily, in arrival order, only as far as the
        GPUs go (see the module docstring); the decision is :meth:`decide_all`'s.

        The records of the recorded jobs are carried over from the last decide when
        ``memory["jobs"]`` lists what that decide returned (the same mapping, or an equal
        one: the simulator keeps the memory it had when a decision returns equal memory);
        a record whose job's view is another object reads its service again, and an
        unchanged record is not dumped again. Other memory (decoded from the log, another
        policy's) builds every record from its entry, so the carried records never change
        a decision (``test_tiresias_l_carried_records_change_no_decision``).
        """
        if self.promote_knob is not None:
            return self.decide_all(view, memory)
        thresholds = self.queue_thresholds_gpu_s
        stored = _stored(memory)
        index = jobs_by_id(view)
        jobs: Sequence[JobView] = view.jobs if view.arrival_ordered else view_arrival_order(view)
        serial = getattr(view.jobs, "serial", 0)
        memo, self._memo = self._memo, None  # spent either way; a failed decide leaves none
        # Every job that may have a place, be demoted, or be given one without a start:
        # the recorded ones, the served ones, the running ones.
        others: dict[str, JobRecord] = {}
        # The records that may be demoted: a carried record whose view is the same has
        # the service it had after the last decide's demotions.
        moved: list[JobRecord] | None = None
        # The jobs that may have service or GPUs without a record: every job, or with the
        # simulator's jobs and carried records, only those rebuilt since (another job's view
        # is the one the last decide saw, when it had a record if it had either).
        look: Iterable[JobView] = jobs
        if memo is not None and (stored is memo[0] or stored == memo[0]):
            rebuilt = _rebuilt_since(view.jobs, memo[2]) if serial else None
            if rebuilt is not None:
                look = [job for job_id in rebuilt if (job := index.get(job_id)) is not None]
            moved = []
            for job_id, rec in memo[1].items():
                job = index.get(job_id)
                if job is not None:
                    if job is not rec.job:
                        rec.see(job, thresholds)
                        moved.append(rec)
                    others[job_id] = rec
        else:
            for job_id, raw in stored.items():
                job = index.get(job_id)
                if job is not None:
                    others[job_id] = _record(job, raw, thresholds)
        position = _next_position(others.values())
        for job in [j for j in look if j.attained_service_gpu_s or j.current_gpus]:
            if job.job_id not in others:
                others[job.job_id] = rec = _record(job, None, thresholds)
                if moved is not None:
                    moved.append(rec)
        now = view.now_s
        # Demotions, in arrival order (an arrival-ordered view is sorted by this key too).
        for rec in sorted(
            (r for r in (others.values() if moved is None else moved) if r.level > r.queue), key=_arrival_key
        ):
            position = _requeue(rec, position, now, None)
        ordered = sorted(others.values(), key=JobRecord.order_key)
        # The fresh jobs' key is (0, unplaced, arrival, id): behind Q0's placed jobs,
        # ahead of Q1. Only the unplaced records of Q0 (jobs with service or GPUs but no
        # place, rare) share that stretch with them, by arrival.
        q1 = bisect.bisect_left(ordered, 1, key=_QUEUE)
        unplaced = bisect.bisect_left(ordered, UNPLACED, 0, q1, key=_POSITION)
        fresh: Iterable[JobView]
        if unplaced < q1:
            merged = heapq.merge(
                ordered[unplaced:q1], _fresh_records(jobs, others, thresholds), key=JobRecord.order_key
            )
            fresh = map(_JOB, merged)
        else:  # the fresh jobs alone, in arrival order (no record needed)
            fresh = (job for job in jobs if job.job_id not in others)
        walk = itertools.chain(map(_JOB, ordered[:unplaced]), fresh, map(_JOB, ordered[q1:]))
        shares = _pass(walk, view.total_gpus)
        started_fresh = sorted(
            (_record(index[j], None, thresholds) for j in shares if j not in others), key=JobRecord.order_key
        )
        if started_fresh:  # their place is that of the fresh jobs, as in the pass
            middle = heapq.merge(ordered[unplaced:q1], started_fresh, key=JobRecord.order_key)
            ordered = [*ordered[:unplaced], *middle, *ordered[q1:]]
        recorded: dict[str, JobRecord] = {}
        new_memory = las_memory(
            view,
            ordered,
            shares,
            thresholds,
            service_since_restart=self.service_since_restart,
            promote_knob=None,
            recorded=recorded,
        )
        self._memo = (new_memory["jobs"], recorded, serial)
        return Decision(shares=shares, memory=new_memory)

    def decide_all(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """:meth:`decide` with a record for every job, all sorted (the reference form;
        the one that runs with a ``promote_knob``)."""
        records = las_records(view, memory, self.queue_thresholds_gpu_s, self.promote_knob)
        shares = _pass(map(_JOB, records), view.total_gpus)
        new_memory = las_memory(
            view,
            records,
            shares,
            self.queue_thresholds_gpu_s,
            service_since_restart=self.service_since_restart,
            promote_knob=self.promote_knob,
        )
        return Decision(shares=shares, memory=new_memory)


_GANG_SIZES: dict[tuple[Any, ...], int] = {}


def gang_size_by_shape(job: JobView) -> int:
    """:func:`gang_size`, memoised on the fields it reads (a Tiresias-L pass or a
    Gandiva_fair decision asks for the size of every job it walks, and most jobs share a
    few shapes)."""
    key = (job.elastic, job.requested_gpus, job.min_gpus, job.max_gpus, job.allowed_gpu_counts)
    try:
        hit = _GANG_SIZES.get(key)
    except TypeError:  # a hand-built view with a list of allowed counts
        return gang_size(job)
    if hit is None:
        hit = gang_size(job)
        if len(_GANG_SIZES) < 4096:
            _GANG_SIZES[key] = hit
    return hit


_JOB = operator.attrgetter("job")
_QUEUE = operator.attrgetter("queue")
_POSITION = operator.attrgetter("position")


def _rebuilt_since(seq: Sequence[JobView], serial: int) -> Collection[str] | None:
    """The ids of the jobs the simulator's sequence ``seq`` rebuilt since its sequence
    numbered ``serial`` (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`); None when
    unknown (another kind of sequence, a decision skipped)."""
    if not serial:
        return None
    rebuilt_since = getattr(seq, "rebuilt_since", None)
    return rebuilt_since(serial) if rebuilt_since is not None else None


def _arrival_key(rec: JobRecord) -> tuple[float, str]:
    return (rec.job.arrival_s, rec.job.job_id)


def _fresh_records(
    jobs: Sequence[JobView], others: Mapping[str, JobRecord], thresholds: Sequence[float]
) -> Iterator[JobRecord]:
    """The jobs not in ``others`` (no record, no service, no GPUs), in arrival order, as
    records: their key is ``(0, unplaced, arrival, id)``, so this is their pass order."""
    for job in jobs:
        if job.job_id not in others:
            yield _record(job, None, thresholds)

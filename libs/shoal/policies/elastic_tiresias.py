"""Elastic-Tiresias: Tiresias plus compaction and expansion (EDL §5.1, Algorithm 1).

Each decision starts from a Tiresias plan (:mod:`shoal.policies.tiresias`): groups
``G0, G1, …`` by attained service, strict priority between groups, each group served
in its list order as the Tiresias simulator keeps it (arrivals and demotions at the
back, waiting jobs behind running ones after each pass), backfill past a job that does
not fit. Then Algorithm 1:

* **Compaction** (lines 1–6), when more than ``N`` jobs wait (``N`` =
  ``compaction_threshold``, 10 in EDL's evaluation; with ``N`` or fewer waiting jobs
  nothing is compacted): for each waiting job ``J̃`` in priority order, GPUs are taken
  by scale-in from running elastic jobs of groups ``G_i, i ≠ 0`` (jobs of the top group
  are never shrunk) so that ``J̃`` can start with its requested GPUs. A victim ``j`` keeps
  at least ``min_j = max(smallest feasible count, ⌈r · p_j⌉)`` GPUs, ``p_j`` its requested
  parallelism and ``r = qos_ratio`` (0.5 in EDL: "r = 0.5 for the quality of service
  guarantee"). ``Gain(J̃, r_j, G_i)``, the gain in GPU efficiency, is measured in
  normalised throughput (speedup over one GPU, ``S(p)/S(1)``): what ``J̃`` adds minus what
  the victims lose. The ``r`` that maximises it is built greedily, one scale-in step at a
  time from the victim that loses the least normalised throughput per freed GPU, until
  ``J̃`` fits; ``J̃`` is admitted only when the total gain is positive. Several victims may
  give to one ``J̃``.
* **Expansion** (lines 7–13), when no job waits: each idle GPU goes to the running
  elastic job with the largest relative throughput gain ``(S(p+1) - S(p)) / S(p)``
  (per GPU when the next feasible count adds several), while some job gains.

Choices where the paper leaves room:

* Tiresias configuration as in EDL's simulation (§6.3): three groups with service
  quanta 500 and 10,000 GPU-seconds; service counted over the job's life
  (``service_since_restart`` off, as in the Tiresias paper).
* Starvation promotion is off by default (``promote_knob=None``), a departure from the
  text of EDL §5.1, which describes it: a job "not scheduled for a long time" returns to
  ``G0``. §5.1 names no threshold, and §6.3 ran on "the simulator provided in [5]"
  (Tiresias') without saying which of its schedules; that it was ``dlas-gpu``, the
  Tiresias schedule, is our inference. That schedule runs with its starvation knob at 0
  (off); the promoting variants are separate schedules, each with a knob value of its
  own. Pass ``promote_knob`` to turn it on: a job in ``G1`` or
  lower whose wait since its preemption reaches the knob times its run time since it
  last entered ``G0`` goes to the back of ``G0`` (the rule of
  :mod:`shoal.policies.tiresias`), and compaction and expansion then see it there.
* Jobs keep their elastic size across decisions. In the Tiresias plan a compacted job
  asks for its present (smaller) count, an expanded job for its request; once every job
  has been planned in priority order, expanded jobs take back their extra GPUs (in
  priority order) from what is still free. So GPUs lent by expansion return to a job
  that would otherwise wait, and stay lent otherwise.
* A waiting job is one the plan left without GPUs whose request fits the cluster; a
  job larger than the cluster never counts (it would block expansion forever).
* The locality rule (footnote 4: the GPUs of ``J̃`` from at most ``⌈P/m⌉`` machines) is
  left to the placer; inelastic jobs (``elastic=False``) are never resized.

Memory: the Tiresias memory of :func:`shoal.policies.tiresias.las_memory` (per-job
service base, first start, preemption time, group and place in the group's list;
``next_decision_at_s`` at the next group change). The policy never reads ``remaining_iterations``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts, jobs_by_id
from shoal.policies.common import view_arrival_order
from shoal.policies.tiresias import (
    _POSITION,
    _QUEUE,
    UNPLACED,
    JobRecord,
    _arrival_key,
    _next_position,
    _rebuilt_since,
    _record,
    _requeue,
    _stored,
    las_memory,
    las_records,
)
from shoal.policies.tiresias import gang_size_by_shape as gang_size


def _rate(job: JobView, gpus: int) -> float:
    if gpus <= 0:
        return 0.0
    curve = job.throughput
    return curve[gpus] if gpus < len(curve) else curve[-1]


def _speedup(job: JobView, gpus: int) -> float:
    """Normalised throughput ``S(p)/S(1)`` (GPU-equivalents of useful work)."""
    one = _rate(job, 1)
    return _rate(job, gpus) / one if one > 0 else 0.0


class ElasticTiresias:
    """Elastic-Tiresias (EDL §5.1, Algorithm 1); see the module docstring."""

    name = "elastic-tiresias"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""

    def __init__(
        self,
        *,
        queue_thresholds_gpu_s: Sequence[float] = (500.0, 10_000.0),
        compaction_threshold: int = 10,
        qos_ratio: float = 0.5,
        service_since_restart: bool = False,
        promote_knob: float | None = None,
    ) -> None:
        """Configure the policy.

        Args:
            queue_thresholds_gpu_s: Service quanta between groups (EDL: 500, 10,000 GPU-s).
            compaction_threshold: ``N``: compaction runs when more than ``N`` jobs wait.
            qos_ratio: ``r``: a shrunk job keeps at least ``⌈r · requested⌉`` GPUs.
            service_since_restart: Count service since the last restart (see Tiresias-L).
            promote_knob: Tiresias' starvation knob (``None``: no promotion).

        Raises:
            ValueError: bad thresholds, a negative ``N`` or ``r`` outside [0, 1].
        """
        thresholds = tuple(float(t) for t in queue_thresholds_gpu_s)
        if any(t <= 0 for t in thresholds) or any(b <= a for a, b in itertools.pairwise(thresholds)):
            raise ValueError(f"queue thresholds must be positive and increasing, got {thresholds}")
        if compaction_threshold < 0:
            raise ValueError(f"compaction_threshold must be non-negative, got {compaction_threshold}")
        if not 0.0 <= qos_ratio <= 1.0:
            raise ValueError(f"qos_ratio must be in [0, 1], got {qos_ratio}")
        self.queue_thresholds_gpu_s = thresholds
        self.compaction_threshold = compaction_threshold
        self.qos_ratio = qos_ratio
        self.service_since_restart = service_since_restart
        self.promote_knob = promote_knob
        self._memo: _Memo | None = None
        """What the last :meth:`decide` returned and the records of it (see there)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Tiresias plan, then compaction (> N waiting) or expansion (none waiting).

        :meth:`decide_all`'s decision, without a record for every job of a long queue.
        Most of such a queue is jobs that never ran: no record in memory, no attained
        service, no GPUs. Each of them would get the same record, ``G0`` with no place,
        which sorts behind ``G0``'s placed jobs, among its unplaced ones by arrival, and
        ahead of ``G1``. No demotion touches them, and :func:`las_memory` writes nothing
        for them unless they get GPUs. So they are walked lazily, in arrival order (their
        order in the view), between the other jobs (sorted):

        * the plan stops at the first job it meets with no GPU free (it gives nothing
          after that, and the lent GPUs it gives back go only to jobs already met);
        * the waiting jobs are counted only up to ``N + 1``;
        * compaction takes them one by one, and stops where Algorithm 1 stops (no victim
          left);
        * only expansion, which runs when no job waits, has walked them all.

        Those "other" jobs are the ones with a record, service or GPUs. Their records are
        carried over from the last decide when ``memory["jobs"]`` lists what that decide
        returned (the same mapping, or an equal one). Then, with the simulator's jobs
        (:meth:`shoal.policies.base.LiveJobs.rebuilt_since` and ``left_since``), only
        the jobs rebuilt since are looked at for new service or GPUs; any other sequence
        takes one pass over every job for that. Memory from elsewhere builds every record
        from its entry. A test checks every decision of two Philly prefixes against
        :meth:`decide_all` (``tests/policies/test_elastic_tiresias.py``).
        """
        if self.promote_knob is not None:
            return self.decide_all(view, memory)  # every waiting job's wait counts
        thresholds = self.queue_thresholds_gpu_s
        total = view.total_gpus
        stored = _stored(memory)
        index = jobs_by_id(view)
        jobs: Sequence[JobView] = view.jobs if view.arrival_ordered else view_arrival_order(view)
        serial = getattr(view.jobs, "serial", 0)
        memo, self._memo = self._memo, None  # spent either way; a failed decide leaves none
        others: dict[str, JobRecord] = {}
        # The records a demotion may move: a carried record whose view is the same has
        # the service it had after the last decide's demotions.
        moved: list[JobRecord] | None = None
        look: Iterable[JobView]  # the jobs that may have service or GPUs without a record
        if memo is not None and (stored is memo.jobs or stored == memo.jobs):
            moved = []
            changes = _rebuilt_since(view.jobs, memo.serial) if serial else None
            for job_id, rec in memo.records.items():
                job = index.get(job_id)
                if job is not None:
                    if job is not rec.job:
                        rec.see(job, thresholds)
                        moved.append(rec)
                    others[job_id] = rec
            if changes is None:
                look = jobs
            else:
                look = [job for job_id in changes if (job := index.get(job_id)) is not None]
        else:
            for job_id, raw in stored.items():
                job = index.get(job_id)
                if job is not None:
                    others[job_id] = _record(job, raw, thresholds)
            look = jobs
        served = [j for j in look if (j.attained_service_gpu_s or j.current_gpus) and j.job_id not in others]
        for job in sorted(served, key=_job_arrival):
            others[job.job_id] = rec = _record(job, None, thresholds)
            if moved is not None:
                moved.append(rec)
        position = _next_position(others.values())
        now = view.now_s
        # Demotions, in arrival order (las_records' order; the other jobs never move).
        for rec in sorted(
            (r for r in (others.values() if moved is None else moved) if r.level > r.queue), key=_arrival_key
        ):
            position = _requeue(rec, position, now, None)
        ordered = sorted(others.values(), key=JobRecord.order_key)
        q1 = bisect.bisect_left(ordered, 1, key=_QUEUE)
        unplaced = bisect.bisect_left(ordered, UNPLACED, 0, q1, key=_POSITION)

        def fresh() -> Iterator[JobView]:
            for job in jobs:
                if job.job_id not in others:
                    yield job

        # Every job in pass order: G0's placed jobs, G0's unplaced ones and the jobs
        # never run (both by arrival: their keys are (0, unplaced, arrival, id)), the rest.
        middle: Iterable[JobView]
        if unplaced < q1:
            middle = heapq.merge((r.job for r in ordered[unplaced:q1]), fresh(), key=_job_arrival)
        else:
            middle = fresh()
        walk = itertools.chain((r.job for r in ordered[:unplaced]), middle, (r.job for r in ordered[q1:]))
        shares, free, walked, rest = self._tiresias_plan_lazily(total, walk, others)
        # The waiting jobs in pass order: the plan's without GPUs, then the ones it never met.
        # Read lazily, partly while compaction runs: that is decide_all's list, as
        # compaction gives GPUs only to the candidate it holds (a later waiting job still
        # has none when it is reached) and never takes a victim's last GPU.
        waiting = (
            job
            for job in itertools.chain((j for j in walked if not shares.get(j.job_id)), rest)
            if 0 < gang_size(job) <= total
        )
        first = list(itertools.islice(waiting, self.compaction_threshold + 1))
        if len(first) > self.compaction_threshold:
            # The victims come from the jobs given GPUs that hold a record (the jobs
            # never run are in G0), in pass order.
            holders = sorted((others[j] for j in shares if j in others), key=JobRecord.order_key)
            free = self._compaction(holders, itertools.chain(first, waiting), shares, free)
        elif not first:  # every job was met (none waits): only the plan gave GPUs
            free = self._expansion([j for j in walked if j.elastic and shares.get(j.job_id)], shares, free)
        shares = {j: g for j, g in shares.items() if g}
        started = sorted(
            (_record(index[j], None, thresholds) for j in shares if j not in others), key=JobRecord.order_key
        )
        if started:  # their place is that of the jobs never run, as in the pass
            merged = heapq.merge(ordered[unplaced:q1], started, key=JobRecord.order_key)
            ordered = [*ordered[:unplaced], *merged, *ordered[q1:]]
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
        self._memo = _Memo(new_memory["jobs"], recorded, serial)
        return Decision(shares=shares, memory=new_memory)

    def decide_all(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """:meth:`decide` with a record for every job, all sorted (the reference form;
        the one that runs with a ``promote_knob``)."""
        records = las_records(view, memory, self.queue_thresholds_gpu_s, self.promote_knob)
        shares, free = self._tiresias_plan(view.total_gpus, records)
        # Jobs that could never fit do not count as waiting (they would block expansion).
        waiting = [
            r.job for r in records if not shares.get(r.job.job_id) and 0 < gang_size(r.job) <= view.total_gpus
        ]
        if len(waiting) > self.compaction_threshold:
            free = self._compaction(records, waiting, shares, free)
        elif not waiting:
            free = self._expansion(
                [r.job for r in records if r.job.elastic and shares.get(r.job.job_id)], shares, free
            )
        shares = {j: g for j, g in shares.items() if g}
        new_memory = las_memory(
            view,
            records,
            shares,
            self.queue_thresholds_gpu_s,
            service_since_restart=self.service_since_restart,
            promote_knob=self.promote_knob,
        )
        return Decision(shares=shares, memory=new_memory)

    @staticmethod
    def _tiresias_plan_lazily(
        total: int, walk: Iterator[JobView], others: Mapping[str, JobRecord]
    ) -> tuple[dict[str, int], int, list[JobView], Iterator[JobView]]:
        """:meth:`_tiresias_plan` over ``walk`` (every job, in pass order), stopped at the
        first job met with no GPU free: the plan gives that job and every later one
        nothing. Returns the shares, the GPUs left, the jobs met (in order) and the rest
        of ``walk`` (``others``: the jobs with a record; only they can hold GPUs)."""
        free = total
        shares: dict[str, int] = {}
        expanded: list[tuple[JobView, tuple[int, ...]]] = []
        walked: list[JobView] = []
        for job in walk:
            if free <= 0:
                return shares, _give_back(expanded, shares, free), walked, itertools.chain((job,), walk)
            walked.append(job)
            gang = gang_size(job)
            want = gang
            current = job.current_gpus
            if current and current in (counts := feasible_counts(job)):
                want = min(current, gang) if job.elastic else current
                if current > want:
                    expanded.append((job, counts))
            if 0 < want <= free:
                shares[job.job_id] = want
                free -= want
        return shares, _give_back(expanded, shares, free), walked, iter(())

    @staticmethod
    def _tiresias_plan(total: int, records: Sequence[JobRecord]) -> tuple[dict[str, int], int]:
        """The Tiresias plan with elastic sizes: lent GPUs come back before anyone waits."""
        free = total
        shares: dict[str, int] = {}
        expanded: list[tuple[JobView, tuple[int, ...]]] = []
        for rec in records:
            job = rec.job
            gang = gang_size(job)
            want = gang
            current = job.current_gpus
            # Feasible counts are positive: only a job holding GPUs can hold one of them
            # (a waiting job, most of a long queue, asks for its gang).
            if current and current in (counts := feasible_counts(job)):
                # A compacted job keeps its smaller size; an expanded one first asks for
                # its request and gets the extra GPUs back below if they are still idle.
                want = min(current, gang) if job.elastic else current
                if current > want:
                    expanded.append((job, counts))
            if 0 < want <= free:
                shares[job.job_id] = want
                free -= want
        return shares, _give_back(expanded, shares, free)

    def _min_size(self, job: JobView, counts: tuple[int, ...]) -> int:
        return max(counts[0], math.ceil(self.qos_ratio * gang_size(job)))

    def _compaction(
        self, records: Sequence[JobRecord], waiting: Iterable[JobView], shares: dict[str, int], free: int
    ) -> int:
        """Algorithm 1 lines 1–6: shrink jobs of groups i ≠ 0 to admit waiting jobs.

        ``records``: at least every job of a group ``i ≠ 0`` given GPUs, with its record,
        in pass order (the victims' order); ``waiting``: the waiting jobs in pass order,
        taken one by one."""
        victims: list[tuple[JobView, tuple[int, ...], int]] = []
        for rec in records:
            job = rec.job
            if rec.queue == 0 or not job.elastic or not shares.get(job.job_id):
                continue
            counts = feasible_counts(job)
            victims.append((job, counts, self._min_size(job, counts)))
        if not victims:
            return free
        # One heap of next scale-in steps for all victims: (cost, victim, from, to).
        # An entry is live while the victim still holds ``from`` GPUs.
        heap: list[tuple[float, int, int, int]] = []
        for i, (job, counts, low) in enumerate(victims):
            has = shares[job.job_id]
            step = self._step_down(job, counts, low, has)
            if step is not None:
                heap.append((step[0], i, has, step[1]))
        heapq.heapify(heap)
        for cand in waiting:
            need = gang_size(cand)
            if need <= free:
                shares[cand.job_id] = need
                free -= need
                continue
            got = free
            loss = 0.0
            taken: list[tuple[float, int, int, int]] = []
            while got < need and heap:
                entry = heapq.heappop(heap)
                _, i, has, to = entry
                job, counts, low = victims[i]
                if shares[job.job_id] != has:
                    continue  # stale
                taken.append(entry)
                loss += _speedup(job, has) - _speedup(job, to)
                got += has - to
                shares[job.job_id] = to
                step = self._step_down(job, counts, low, to)
                if step is not None:
                    heapq.heappush(heap, (step[0], i, to, step[1]))
            if got >= need and _speedup(cand, need) - loss > 0:
                shares[cand.job_id] = need
                free = got - need
                continue
            # Not worth it (or not enough to take): undo, and the steps are live again.
            for entry in reversed(taken):
                _, i, has, _ = entry
                shares[victims[i][0].job_id] = has
                heapq.heappush(heap, entry)
            if not heap:
                break
        return free

    @staticmethod
    def _step_down(job: JobView, counts: tuple[int, ...], low: int, has: int) -> tuple[float, int] | None:
        """Cheapest next scale-in of ``job``: (lost speedup per freed GPU, new count)."""
        i = bisect.bisect_left(counts, has)  # feasible counts are increasing
        if i == 0 or counts[i - 1] < low:
            return None
        to = counts[i - 1]
        return ((_speedup(job, has) - _speedup(job, to)) / (has - to), to)

    @staticmethod
    def _expansion(jobs: Sequence[JobView], shares: dict[str, int], free: int) -> int:
        """Algorithm 1 lines 7–13: idle GPUs to the largest relative throughput gain
        (``jobs``: the elastic jobs given GPUs, in pass order)."""

        def step_up(i: int) -> tuple[float, int] | None:
            job = jobs[i]
            has = shares[job.job_id]
            for c in feasible_counts(job):
                if c > has:
                    if c - has > free:
                        return None
                    before = _rate(job, has)
                    gain = (_rate(job, c) - before) / before / (c - has) if before > 0 else 0.0
                    return (gain, c) if gain > 0 else None
            return None

        heap: list[tuple[float, int, int]] = []
        for i in range(len(jobs)):
            s = step_up(i)
            if s is not None:
                heap.append((-s[0], i, s[1]))
        heapq.heapify(heap)
        while heap and free > 0:
            _, i, to = heapq.heappop(heap)
            s = step_up(i)  # free may have shrunk since this entry was pushed
            if s is None or s[1] != to:
                continue
            free -= to - shares[jobs[i].job_id]
            shares[jobs[i].job_id] = to
            s = step_up(i)
            if s is not None:
                heapq.heappush(heap, (-s[0], i, s[1]))
        return free


def _give_back(expanded: Sequence[tuple[JobView, tuple[int, ...]]], shares: dict[str, int], free: int) -> int:
    """The plan's last step: expanded jobs (in pass order) take back their extra GPUs from
    what is still free; returns the GPUs left."""
    for job, counts in expanded:
        has = shares.get(job.job_id, 0)
        if not has:
            continue
        fits = [c for c in counts if has < c <= min(job.current_gpus, has + free)]
        if fits:
            free -= fits[-1] - has
            shares[job.job_id] = fits[-1]
    return free


def _job_arrival(job: JobView) -> tuple[float, str]:
    return (job.arrival_s, job.job_id)


class _Memo:
    """What :meth:`ElasticTiresias.decide` keeps for the next: the jobs mapping of the
    memory it returned, the records that mapping lists (job id -> record) and the serial
    of its jobs (:attr:`shoal.policies.base.LiveJobs.serial`; 0: not a simulator's)."""

    __slots__ = ("jobs", "records", "serial")

    def __init__(self, jobs: Mapping[str, Any], records: dict[str, JobRecord], serial: int) -> None:
        self.jobs = jobs
        self.records = records
        self.serial = serial

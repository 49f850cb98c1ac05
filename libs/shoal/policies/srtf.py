"""SRTF, SRSF and their altruistic elastic versions SRTF-E and SRSF-E (AFS/CoDDL §2.2, §5.5).

* **SRTF** (shortest remaining time first): preemptive and non-elastic. At every
  decision, jobs are ranked by their known remaining time at their request,
  ``remaining_iterations / throughput[request]``, and given all of their request
  (:func:`~shoal.policies.common.request_size`) or nothing (AFS §2.2, REPRODUCTION.md).
* **SRSF** (shortest remaining service first, Tiresias [24], AFS §2.2): the same with
  remaining *service*, remaining time × requested GPUs, which penalises wide jobs.
* **SRTF-E / SRSF-E** (AFS §5.5, after altruistic scheduling [22]): "it first schedules
  jobs to achieve the primary goal (in this case, assigning the user-requested number
  of GPUs) and then distributes leftover resources for the secondary goal (in this
  case, assigning more GPUs to achieve the largest throughput)".

Choices where the paper leaves room:

* **Backfill.** A job whose request does not fit is skipped and later jobs are still
  considered (REPRODUCTION.md: the non-elastic baselines "scan on past a job that does
  not fit"); no job is given part of its request.
* **Ties** in remaining time/service go to the earlier arrival, then the smaller job id.
  A job of unknown length (``remaining_iterations is None``) ranks after every job of
  known length; one that makes no progress at its request ranks last as well.
* **Leftover GPUs in the -E versions** go only to jobs scheduled by the primary goal
  (a waiting job is not started below its request: that would change the primary
  goal's all-or-nothing rule), one feasible step at a time, each step to the job whose
  step adds the most *normalised* throughput per GPU, ``(p(next) - p(now)) /
  (p(1) · step)`` — iterations/s are not comparable across models, speedups are
  (the CE metric of AFS §2.2 normalises the same way). Jobs grow up to ``max_gpus``
  (REPRODUCTION.md: the elastic versions are not held to the request); a step that
  adds no throughput is never taken. Ties go to the earlier arrival.
* **Figure 6 variant** (``use_max_gpus=True``, AFS §5.2): a job's all-or-nothing size
  is "the maximum number of GPUs each job can utilize" instead of its request, taken
  as the smallest feasible count with the job's peak throughput.
* No memory: SRTF/SRSF re-decide from the view at every event.

Cost of a decision in a long queue: a job's rank key (its remaining time or service
at its size, then arrival) is read from its view alone, and a waiting job's view does
not change while it waits. So the keys of every job are kept sorted from one decision
to the next, and with the simulator's jobs
(:meth:`shoal.policies.base.LiveJobs.rebuilt_since`, ``left_since``) only the jobs
whose view was rebuilt (the running ones, arrivals) are ranked again; the walk down the
ranking stops when no GPU is free. Any other sequence of jobs ranks every job afresh.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts, jobs_by_id
from shoal.policies.common import Ladder, arrival_order, remaining_time_s, request_size, throughput_at


def _normaliser(job: JobView) -> float:
    base = throughput_at(job, 1)
    if base > 0.0:
        return base
    positive = [v for v in job.throughput if v > 0.0]
    return min(positive) if positive else 1.0


def peak_size(job: JobView) -> int:
    """The smallest feasible count at which ``job`` reaches its peak throughput (0: none)."""
    best, best_rate = 0, -1.0
    for count in feasible_counts(job):
        rate = throughput_at(job, count)
        if rate > best_rate:
            best, best_rate = count, rate
    return best


class _ShortestFirst:
    """Non-elastic shortest-remaining-first with backfill; ``altruistic`` adds -E.

    Args:
        use_max_gpus: size each job at its peak-throughput count instead of its request
            (the relaxed cap of AFS §5.2, Figure 6).
    """

    name = ""
    elastic = False
    """All-or-nothing: each share is the job's request, never regulated; the altruistic -E versions are elastic (:attr:`shoal.policies.base.Policy.elastic`)."""
    service = False
    """Rank by remaining service (time × GPUs) instead of remaining time."""
    altruistic = False

    def __init__(self, use_max_gpus: bool = False) -> None:
        self.use_max_gpus = use_max_gpus
        self._ranking = _Ranking()

    def _priority(self, job: JobView, size: int) -> float:
        t = remaining_time_s(job, size)
        if self.service and not math.isinf(t):
            return t * size
        return t

    def _key(self, job: JobView) -> _Key | None:
        """``job``'s place in the ranking, ``(priority, arrival, id, size)``: the order
        of ``(priority, arrival rank)``, as ids are unique. None: no size, never given GPUs."""
        size = peak_size(job) if self.use_max_gpus else request_size(job)
        if size <= 0:
            return None
        return (self._priority(job, size), job.arrival_s, job.job_id, size)

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Requests in increasing remaining time (service), then leftovers for -E."""
        keys = self._ranking.keys_of(view, self._key)
        free = view.total_gpus
        shares: dict[str, int] = {}
        for _, _, job_id, size in keys:
            if free <= 0:
                break  # every size is positive: nothing more fits
            if size <= free:
                shares[job_id] = size
                free -= size
        if self.altruistic and free > 0:
            index = jobs_by_id(view)
            self._distribute_leftover(arrival_order(index[j] for j in shares), shares, free)
        return Decision(shares=shares)

    @staticmethod
    def _distribute_leftover(jobs: list[JobView], shares: dict[str, int], free: int) -> None:
        """AFS §5.5: the secondary goal, the largest throughput, with the leftover GPUs.
        ``jobs``: the jobs given GPUs, in arrival order (a job's rank: its place there)."""
        heap: list[tuple[float, int, int, int]] = []
        ladders: dict[int, Ladder] = {}
        norms: dict[int, float] = {}

        def push(rank: int, count: int) -> None:
            job = jobs[rank]
            nxt = ladders[rank].next_count(count)
            if nxt == 0:
                return
            gain = (throughput_at(job, nxt) - throughput_at(job, count)) / (norms[rank] * (nxt - count))
            if gain > 0.0:
                heapq.heappush(heap, (-gain, rank, count, nxt))

        for rank, job in enumerate(jobs):
            count = shares.get(job.job_id, 0)
            if count > 0 and job.elastic:
                ladders[rank] = Ladder(job)
                norms[rank] = _normaliser(job)
                push(rank, count)
        while heap and free > 0:
            _, rank, count, nxt = heapq.heappop(heap)
            if nxt - count > free:
                continue  # free GPUs only decrease: this job cannot grow any more
            shares[jobs[rank].job_id] = nxt
            free -= nxt - count
            push(rank, nxt)


class SRTF(_ShortestFirst):
    """Shortest remaining time first, preemptive, requested GPUs or nothing (non-elastic)."""

    name = "srtf"


class SRSF(_ShortestFirst):
    """Shortest remaining service (time × GPUs) first, preemptive, non-elastic (Tiresias)."""

    name = "srsf"
    service = True


class SRTFElastic(_ShortestFirst):
    """SRTF-E: SRTF, then leftover GPUs to the largest throughput gain (altruistic, AFS §5.5)."""

    name = "srtf-e"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    altruistic = True


class SRSFElastic(_ShortestFirst):
    """SRSF-E: SRSF, then leftover GPUs to the largest throughput gain (altruistic, AFS §5.5)."""

    name = "srsf-e"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    service = True
    altruistic = True


_Key = tuple[float, float, str, int]


class _Ranking:
    """Every job's rank key (:meth:`_ShortestFirst._key`), sorted, kept between decisions.

    ``of`` maps a job id to the view its key was read from and the key (None: never
    ranked). With the simulator's jobs, the decision after the one that read them names
    the views it rebuilt and the jobs that left (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`,
    ``left_since``): only those are read again, the others' views are the very objects
    the keys came from. Any other sequence (a tuple, a decision skipped) reads every job.
    """

    __slots__ = ("keys", "of", "serial")

    def __init__(self) -> None:
        self.keys: list[_Key] = []
        self.of: dict[str, tuple[JobView, _Key | None]] = {}
        self.serial = 0

    def keys_of(self, view: ClusterView, key: Callable[[JobView], _Key | None]) -> list[_Key]:
        """The sorted keys of ``view``'s jobs (``key``: job -> its key or None)."""
        serial = getattr(view.jobs, "serial", 0)
        changes = _changed_since(view.jobs, self.serial) if serial else None
        self.serial = 0  # until brought up to date (a failed call leaves nothing to take)
        keys, of = self.keys, self.of
        if changes is None:
            of.clear()
            for job in view.jobs:
                of[job.job_id] = (job, key(job))
            if len(of) != len(view.jobs):  # an id twice: rank each entry, keep nothing
                keys[:] = sorted(k for j in view.jobs if (k := key(j)) is not None)
                return keys
            keys[:] = sorted(k for _, k in of.values() if k is not None)
            self.serial = serial
            return keys
        rebuilt, left = changes
        for job_id in left:
            kept = of.pop(job_id, None)
            if kept is not None and kept[1] is not None:
                del keys[bisect.bisect_left(keys, kept[1])]
        if rebuilt:
            index = jobs_by_id(view)
            for job_id in rebuilt:
                now = index.get(job_id)
                kept = of.get(job_id)
                if kept is not None:
                    if kept[0] is now:
                        continue
                    if kept[1] is not None:
                        del keys[bisect.bisect_left(keys, kept[1])]
                if now is None:
                    of.pop(job_id, None)
                    continue
                k = key(now)
                of[job_id] = (now, k)
                if k is not None:
                    bisect.insort(keys, k)
        self.serial = serial
        return keys


def _changed_since(seq: Sequence[JobView], serial: int) -> tuple[Collection[str], Collection[str]] | None:
    """The ids of the jobs the simulator's sequence ``seq`` rebuilt, and of those that
    left, since its sequence numbered ``serial``; None when unknown."""
    if not serial:
        return None
    rebuilt_since = getattr(seq, "rebuilt_since", None)
    left_since = getattr(seq, "left_since", None)
    if rebuilt_since is None or left_since is None:
        return None
    rebuilt, left = rebuilt_since(serial), left_since(serial)
    if rebuilt is None or left is None:
        return None
    return rebuilt, left

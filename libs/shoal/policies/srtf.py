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
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts
from shoal.policies.common import Ladder, remaining_time_s, request_size, throughput_at, view_arrival_order


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

    def _priority(self, job: JobView, size: int) -> float:
        t = remaining_time_s(job, size)
        if self.service and not math.isinf(t):
            return t * size
        return t

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Requests in increasing remaining time (service), then leftovers for -E."""
        jobs = view_arrival_order(view)
        ranked = []
        for rank, job in enumerate(jobs):
            size = peak_size(job) if self.use_max_gpus else request_size(job)
            if size > 0:
                ranked.append((self._priority(job, size), rank, size))
        ranked.sort()
        free = view.total_gpus
        shares: dict[str, int] = {}
        for _, rank, size in ranked:
            if size <= free:
                shares[jobs[rank].job_id] = size
                free -= size
        if self.altruistic and free > 0:
            self._distribute_leftover(jobs, shares, free)
        return Decision(shares=shares)

    @staticmethod
    def _distribute_leftover(jobs: list[JobView], shares: dict[str, int], free: int) -> None:
        # AFS §5.5: the secondary goal, the largest throughput, with the leftover GPUs.
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

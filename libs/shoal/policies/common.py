"""Small helpers shared by the AFS, SRTF/SRSF, FIFO and Max-Min policies.

Conventions used by every policy built on these helpers:

* **Deterministic order.** Where a paper says "any job" or "at random", jobs are taken
  in :func:`arrival_order`: earlier ``arrival_s`` first, then smaller ``job_id``.
* **Steps.** An elastic job grows from one feasible count to the next
  (:func:`next_count`); a step may add more than one GPU when ``allowed_gpu_counts``
  skips counts. A non-elastic job has one step, from 0 to ``requested_gpus``.
* **Throughput beyond the curve.** A count past the end of the curve gets the curve's
  last value (no further speedup), as :func:`shoal.view.job_curve` extends curves.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Iterable, Sequence

from shoal.policies.base import ClusterView, JobView, feasible_counts

_ARRIVAL_KEY = operator.attrgetter("arrival_s", "job_id")
"""The sort key of :func:`arrival_order`."""


def arrival_order(jobs: Iterable[JobView]) -> list[JobView]:
    """Jobs by arrival time, then job id (the deterministic tie-break)."""
    return sorted(jobs, key=_ARRIVAL_KEY)


def view_arrival_order(view: ClusterView) -> list[JobView]:
    """:func:`arrival_order` of the view's jobs, without sorting when the view says
    they already are (``ClusterView.arrival_ordered``)."""
    return list(view.jobs) if view.arrival_ordered else arrival_order(view.jobs)


def throughput_at(job: JobView, gpus: int) -> float:
    """Iterations/s of ``job`` with ``gpus`` GPUs (0 GPUs: 0)."""
    if gpus <= 0:
        return 0.0
    curve = job.throughput
    if gpus < len(curve):
        return float(curve[gpus])
    return float(curve[-1]) if len(curve) > 1 else 0.0


def request_size(job: JobView) -> int:
    """The GPUs a non-elastic baseline gives ``job``: all of its request or nothing.

    ``requested_gpus`` when feasible, else the largest feasible count below it, else the
    smallest feasible count; 0 when the job has no feasible count.
    """
    counts = feasible_counts(job)
    if not counts:
        return 0
    want = job.requested_gpus
    if want in counts:
        return want
    i = bisect.bisect_right(counts, want)
    return counts[i - 1] if i > 0 else counts[0]


class Ladder:
    """The feasible counts of one job, for stepping up one count at a time."""

    __slots__ = ("allowed", "elastic", "max_gpus", "min_gpus", "requested")

    def __init__(self, job: JobView) -> None:
        self.elastic = job.elastic
        self.requested = job.requested_gpus
        self.min_gpus = max(1, job.min_gpus)
        self.max_gpus = job.max_gpus
        self.allowed: Sequence[int] | None = (
            sorted(set(job.allowed_gpu_counts)) if job.elastic and job.allowed_gpu_counts else None
        )

    def next_count(self, gpus: int) -> int:
        """The smallest feasible count above ``gpus``; 0 when there is none."""
        if not self.elastic:
            return self.requested if gpus < self.requested and self.requested > 0 else 0
        want = max(gpus + 1, self.min_gpus)
        if self.allowed is not None:
            i = bisect.bisect_left(self.allowed, want)
            if i == len(self.allowed):
                return 0
            want = self.allowed[i]
        return want if want <= self.max_gpus else 0

    def first(self) -> int:
        """The smallest feasible count (0 when the job has none)."""
        return self.next_count(0)


def next_count(job: JobView, gpus: int) -> int:
    """The smallest feasible count of ``job`` above ``gpus``; 0 when there is none."""
    return Ladder(job).next_count(gpus)


def remaining_time_s(job: JobView, gpus: int) -> float:
    """Known remaining time with ``gpus`` GPUs; infinite when the length is unknown or
    the job makes no progress with that many GPUs (length-aware policies only)."""
    remaining = job.remaining_iterations
    rate = throughput_at(job, gpus)
    if remaining is None or rate <= 0.0:
        return math.inf
    return remaining / rate

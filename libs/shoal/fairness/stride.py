"""Gang-aware stride scheduling (Algorithm 1) and lottery with backfilling.

Gandiva_fair §3.1. Every quantum, Algorithm 1 walks the jobs in increasing pass
order and schedules each one whose gang fits in the GPUs still free; a scheduled
job's pass advances by its stride, a skipped job keeps its pass (so next quantum
it is first in line: at most one quantum of service delay against classic stride).

Choices:

- ``stride = stride1 · size / job_tickets``, i.e. ``stride1 / tickets_per_gpu``.
  A job occupies ``size`` GPUs per quantum it runs, so its pass must advance in
  proportion to the GPU-time it consumes per ticket. With ``stride1 / tickets``
  Table 2's 66.7/33.3/16.7 % split does not appear (REPRODUCTION.md; NOTES §1.1.A).
- Ties among equal passes are broken by (size ascending, arrival, job id). With
  smaller-size-first (or id) Table 2 is exact within 6 quanta; larger-first needs
  hundreds of quanta (NOTES Appendix A).
- Passes are floats; pass arithmetic is deterministic IEEE, so a replay from the
  same passes decides the same. A job with no tickets has an infinite stride: it
  is placed after every ticketed job and its pass never moves.
- A new job starts at the minimum pass of the jobs already there (§3.1); with no
  other job it starts at 0.
- Lottery with backfilling (the unfair contrast of Table 2) draws, without
  replacement, jobs weighted by tickets per GPU (``job_tickets / size``, "divide
  tickets by number of GPUs", §3.1) and skips a winner that does not fit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, cast

from msgspec import Struct

#: The stride constant ("stride1" in Waldspurger's stride scheduling).
STRIDE1: float = 1.0


class StrideJob(Struct, frozen=True, kw_only=True):
    """A job as the gang-aware stride scheduler sees it."""

    job_id: str
    size: int
    """GPUs the gang needs (all at once)."""
    job_tickets: float
    """Tickets of the job, eq. (3): ``tickets_per_gpu · size``."""
    arrival_s: float = 0.0


class Gang(Protocol):
    """What Algorithm 1 reads of a job: :class:`StrideJob`'s fields (a
    :class:`~shoal.fairness.split_stride.PlacedJob` has them too, so split stride
    passes its small jobs as they are)."""

    @property
    def job_id(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def job_tickets(self) -> float: ...

    @property
    def arrival_s(self) -> float: ...


class StrideResult(Struct, frozen=True, kw_only=True):
    """One quantum of Algorithm 1."""

    scheduled: tuple[str, ...]
    """Jobs that run this quantum, in the order they were picked."""
    passes: dict[str, float]
    """Every job's pass value after the quantum."""
    free_gpus: int
    """GPUs left idle this quantum."""


def stride(size: int, job_tickets: float, stride1: float = STRIDE1) -> float:
    """The stride of a gang of ``size`` GPUs holding ``job_tickets`` tickets.

    Args:
        size: GPUs of the gang.
        job_tickets: Tickets of the job (eq. (3)).
        stride1: The stride constant.

    Returns:
        ``stride1 · size / job_tickets``; ``inf`` when the job has no tickets.
    """
    if job_tickets <= 0:
        return math.inf
    return stride1 * size / job_tickets


def new_job_pass(passes: Iterable[float]) -> float:
    """Pass of a job joining a scheduler: the minimum pass there, or 0 (§3.1)."""
    finite = [p for p in passes if math.isfinite(p)]
    return min(finite) if finite else 0.0


def order_key(pass_value: float, job_tickets: float, size: int, arrival_s: float, job_id: str) -> tuple:
    """The documented total order of Algorithm 1 line 2, with the tie-break."""
    return (job_tickets <= 0, pass_value, size, arrival_s, job_id)


def gang_aware_stride(
    jobs: Sequence[Gang],
    num_gpus: int,
    passes: Mapping[str, float],
    stride1: float = STRIDE1,
) -> StrideResult:
    """Run one quantum of gang-aware stride (Algorithm 1) on one server.

    Args:
        jobs: The jobs on the server.
        num_gpus: GPUs of the server.
        passes: Job id -> pass value; a job missing here starts at :func:`new_job_pass`.
        stride1: The stride constant.

    Returns:
        The scheduled jobs and every job's new pass value.
    """
    scheduled: list[str] = []
    new_passes: dict[str, float] = {}
    free = gang_aware_stride_into(jobs, num_gpus, passes, stride1, scheduled, new_passes)
    return StrideResult(scheduled=tuple(scheduled), passes=new_passes, free_gpus=free)


def gang_aware_stride_into(
    jobs: Sequence[Gang],
    num_gpus: int,
    passes: Mapping[str, float],
    stride1: float,
    scheduled: list[str],
    new_passes: dict[str, float],
) -> int:
    """:func:`gang_aware_stride`, its result written into the caller's: the jobs picked
    appended to ``scheduled``, every job's pass set in ``new_passes`` (in ``jobs`` order);
    returns the GPUs left idle. Split stride runs it on every server every quantum and
    gathers the servers' results in one list and one dict."""
    if len(jobs) == 1:
        # The steps below for a lone job (common while the queue is short): its own
        # pass, else new_job_pass of no other pass (0); it runs if it fits.
        job = jobs[0]
        job_id = job.job_id
        value = passes.get(job_id, 0.0)
        if num_gpus > 0 and job.size <= num_gpus:
            step = stride(job.size, job.job_tickets, stride1)
            if math.isfinite(step):
                value += step
            scheduled.append(job_id)
            new_passes[job_id] = value
            return num_gpus - job.size
        new_passes[job_id] = value
        return num_gpus
    known = [passes.get(j.job_id) for j in jobs]
    if None in known:  # a new job starts at new_job_pass of the others' passes
        start = new_job_pass([p for p in known if p is not None])
        current = [start if p is None else p for p in known]
    else:
        current = cast("list[float]", known)
    for j, p in zip(jobs, current, strict=True):
        new_passes[j.job_id] = p
    # order_key, inline, on decorated tuples (no key function called per job); the
    # position last, so equal keys keep their order as a stable sort does.
    ranked = [(j.job_tickets <= 0, current[i], j.size, j.arrival_s, j.job_id, i) for i, j in enumerate(jobs)]
    ranked.sort()
    free = num_gpus
    for r in ranked:  # Algorithm 1, lines 6-12
        if free <= 0:
            break
        job = jobs[r[5]]
        if job.size <= free:
            free -= job.size
            scheduled.append(job.job_id)
            step = stride(job.size, job.job_tickets, stride1)
            if math.isfinite(step):
                new_passes[job.job_id] += step
    return free


def lottery_with_backfilling(
    jobs: Sequence[StrideJob],
    num_gpus: int,
    rng: random.Random,
) -> tuple[str, ...]:
    """One quantum of lottery scheduling with backfilling (§3.1, Table 2 row 1).

    Tickets are normalised by gang size; winners are drawn without replacement and
    a winner that does not fit is skipped, until the server is full or nothing fits.

    Args:
        jobs: The jobs on the server.
        num_gpus: GPUs of the server.
        rng: The random source (seed it for a deterministic run).

    Returns:
        The jobs that run this quantum.
    """
    pool = sorted((j for j in jobs if j.job_tickets > 0 and j.size > 0), key=lambda j: j.job_id)
    free = num_gpus
    scheduled: list[str] = []
    while free > 0 and pool:
        pool = [j for j in pool if j.size <= free]
        if not pool:
            break
        weights = [j.job_tickets / j.size for j in pool]
        pick = rng.choices(range(len(pool)), weights=weights, k=1)[0]
        job = pool.pop(pick)
        free -= job.size
        scheduled.append(job.job_id)
    return tuple(scheduled)


def gpu_quanta_by_job(
    jobs: Sequence[StrideJob],
    num_gpus: int,
    quanta: int,
    *,
    lottery_seed: int | None = None,
    stride1: float = STRIDE1,
) -> dict[str, int]:
    """Run ``quanta`` quanta on one server and count the quanta each job ran.

    Args:
        jobs: The jobs, all present from the start.
        num_gpus: GPUs of the server.
        quanta: Number of quanta.
        lottery_seed: When set, use lottery with backfilling seeded with it;
            otherwise gang-aware stride starting from all-zero passes.
        stride1: The stride constant.

    Returns:
        Job id -> number of quanta in which the job ran.
    """
    ran = {j.job_id: 0 for j in jobs}
    rng = random.Random(lottery_seed)
    passes: dict[str, float] = {j.job_id: 0.0 for j in jobs}
    for _ in range(quanta):
        if lottery_seed is None:
            result = gang_aware_stride(jobs, num_gpus, passes, stride1)
            passes = result.passes
            scheduled: Iterable[str] = result.scheduled
        else:
            scheduled = lottery_with_backfilling(jobs, num_gpus, rng)
        for job_id in scheduled:
            ran[job_id] += 1
    return ran

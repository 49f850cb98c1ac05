"""FIFO with requested GPUs: the non-elastic baseline (AFS/CoDDL §5.1, REPRODUCTION.md).

Jobs are served in arrival order (``arrival_s``, then ``job_id``), each with all of its
request (:func:`~shoal.policies.common.request_size`) or nothing.

Choices where the sources leave room:

* **No preemption.** A running job (``current_gpus > 0``, read from the folded state)
  keeps its request until it completes; FIFO never displaces it (REPRODUCTION.md). Only
  when the cluster shrank below what running jobs hold (a node went down) are the
  youngest running jobs stopped, oldest kept first.
* **Backfill** (default): a waiting job that does not fit is skipped and later jobs
  that fit start, as production batch schedulers do and as the AFS simulator's
  non-elastic baselines do ("scan on past a job that does not fit").
  ``backfill=False`` gives strict head-of-line blocking: nothing behind the first job
  that does not fit starts.
* No memory: who runs is derived from the view, so a replay decides the same.

Cost of a decision in a long queue (:meth:`FIFO.decide`): the running jobs are found
with one tight pass over the view (``current_gpus``), and the waiting jobs are walked
in arrival order only while GPUs are free: once none is, no later job can start (every
start needs at least one GPU). :meth:`FIFO.decide_all` is the literal two-pass form
(every job's request size, every waiting job walked); a property test checks both
decide alike. On the 51,258 jobs of Philly VC 6214e9 the literal form did about 10 ms
of work per decision over the long queue (``benchmarks/reports/
simulation_speed_policies.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.policies.base import ClusterView, Decision
from shoal.policies.common import request_size, view_arrival_order


class FIFO:
    """FIFO with requested GPUs, non-preemptive, with backfill (non-elastic baseline)."""

    name = "fifo"
    elastic = False
    """All-or-nothing: each share is the job's request, never regulated (:attr:`shoal.policies.base.Policy.elastic`)."""
    reads_progress = False
    """It reads arrival, request, feasible counts and current GPUs only, never progress
    (:func:`shoal.policies.base.policy_reads_progress`)."""

    def __init__(self, backfill: bool = True) -> None:
        self.backfill = backfill

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Keep running jobs, then start waiting jobs in arrival order while they fit.

        The decision is :meth:`decide_all`'s; the queue is walked only while GPUs are
        free (see the module docstring)."""
        jobs = view.jobs if view.arrival_ordered else view_arrival_order(view)
        free = view.total_gpus
        shares: dict[str, int] = {}
        # Running jobs, oldest first, keep their request while it fits. One that does
        # not fit now never fits below (free only shrinks): it waits with the others.
        for job in [j for j in jobs if j.current_gpus > 0]:
            size = request_size(job)
            if 0 < size <= free:
                shares[job.job_id] = size
                free -= size
        if free <= 0:
            return Decision(shares=shares)
        for job in jobs:
            if job.job_id in shares:
                continue
            size = request_size(job)
            if size <= 0:
                continue
            if size <= free:
                shares[job.job_id] = size
                free -= size
                if free <= 0:
                    break  # nothing later can start
            elif not self.backfill:
                break
        return Decision(shares=shares)

    def decide_all(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """:meth:`decide` in its literal form: every job's request size, every waiting
        job walked (the reference a property test compares :meth:`decide` with)."""
        jobs = view_arrival_order(view)
        free = view.total_gpus
        shares: dict[str, int] = {}
        waiting = []
        for job in jobs:
            size = request_size(job)
            if job.current_gpus > 0 and 0 < size <= free:
                shares[job.job_id] = size
                free -= size
            else:
                waiting.append((job, size))
        for job, size in waiting:
            if size <= 0:
                continue
            if size <= free:
                shares[job.job_id] = size
                free -= size
            elif not self.backfill:
                break
        return Decision(shares=shares)

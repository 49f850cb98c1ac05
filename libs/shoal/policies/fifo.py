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

    def __init__(self, backfill: bool = True) -> None:
        self.backfill = backfill

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Keep running jobs, then start waiting jobs in arrival order while they fit."""
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

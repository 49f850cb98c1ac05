"""The live allocator's progress estimate: running jobs carried to the decision instant.

Progress reports are periodic (and in whole iterations), so the fold's ``iteration``
lags behind a running job; the simulator's view has exact progress
(:meth:`shoal.sim.engine.Simulator._view`). :func:`carry_progress_forward` gives the
allocator service's view the same, from the newest report and the newest change of
share. The simulator never calls it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from shoal.policies.base import ClusterView
from shoal.policies.common import throughput_at
from shoal.state import ClusterState
from shoal.view import job_view_at


def carry_progress_forward(
    view: ClusterView, state: ClusterState, now: float, resumed_at: Mapping[str, float]
) -> ClusterView:
    """The view with each running job's progress carried from its newest report to
    ``now`` at its current share's throughput (the allocator service's view).

    Reports are periodic (and in whole iterations), so the fold's ``iteration`` lags;
    a length-aware policy (SRTF, SRSF, AFS-L) ranks jobs by what is left, and the
    simulator's view has exact progress. Progress resumes after the newest change of
    share (``since``) plus its stop time, once that reconfiguration is reported
    complete (``resumed_at``: job id -> instant of its newest
    ``ReconfigurationCompleted``; otherwise from ``since``); before that change the job
    ran under the shape its last report was made under, which the trainer reports at
    every change instant, so a report older than ``since`` means the job was waiting.

    A running job that has not reported yet ran from its newest change (plus its stop)
    on from its folded iteration (0 for a new job), by the same rule. Its first
    periodic report may come seconds (of virtual time, at a large time scale) after it
    started; left at 0 until then, a job that started 4 s before the next arrival was
    ranked by SRTF as not started, tied with that arrival to the last bit, and lost its
    GPUs to it in the live stack but not in the simulator (conformance, issue 21).
    """
    jobs = []
    changed = False
    for jv in view.jobs:
        job = state.jobs[jv.job_id]
        if not job.gpus or jv.total_iterations is None:
            jobs.append(jv)
            continue
        resumed = resumed_at.get(jv.job_id, -math.inf)
        reported = -math.inf if job.last_progress_at is None else job.last_progress_at
        start = max(reported, resumed if resumed >= job.since - 1e-9 else job.since)
        rate = throughput_at(jv, job.gpus)
        done = min(jv.total_iterations, job.iteration + rate * max(0.0, now - start))
        jobs.append(job_view_at(jv, job, now=now, iterations_done=done))
        changed = True
    return msgspec.structs.replace(view, jobs=tuple(jobs)) if changed else view

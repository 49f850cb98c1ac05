"""Tiny policies for the simulator's own tests (the real ones live in shoal.policies)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.policies.base import ClusterView, Decision


class ToyFifo:
    """Requested GPUs in arrival order; running jobs keep theirs; scan on past a misfit."""

    name = "toy-fifo"

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        free = view.total_gpus - sum(j.current_gpus for j in view.jobs)
        shares = {j.job_id: j.current_gpus for j in view.jobs if j.current_gpus}
        for job in sorted(view.jobs, key=lambda j: (j.arrival_s, j.job_id)):
            if job.job_id in shares:
                continue
            if job.requested_gpus <= free:
                shares[job.job_id] = job.requested_gpus
                free -= job.requested_gpus
        return Decision(shares=shares)


class ToyEqual:
    """Elastic: GPUs split as evenly as possible (oldest jobs get the remainder), capped at max."""

    name = "toy-equal"

    def __init__(self, tick_s: float | None = None) -> None:
        if tick_s is not None:
            self.tick_s = tick_s

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        jobs = sorted(view.jobs, key=lambda j: (j.arrival_s, j.job_id))
        shares = {j.job_id: 0 for j in jobs}
        free = view.total_gpus
        progress = True
        while free > 0 and progress:
            progress = False
            for job in jobs:
                if free == 0:
                    break
                if shares[job.job_id] < job.max_gpus:
                    shares[job.job_id] += 1
                    free -= 1
                    progress = True
        ticks = int(memory.get("decisions", 0)) + 1
        return Decision(shares={k: v for k, v in shares.items() if v}, memory={"decisions": ticks})

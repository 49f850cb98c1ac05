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
    elastic = True

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


class ToyTyped:
    """Heterogeneous FIFO: requested GPUs on the generation fastest for the job that has room.

    Running jobs keep their share and generation; ``types`` (optional) restricts the
    generations tried, in order, instead of fastest first.
    """

    name = "toy-typed"

    def __init__(self, types: tuple[str, ...] | None = None) -> None:
        self.types = types

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        free = dict(view.gpus_by_type)
        shares: dict[str, int] = {}
        gpu_types: dict[str, str] = {}
        for job in view.jobs:
            if job.current_gpus:
                shares[job.job_id] = job.current_gpus
                gpu_types[job.job_id] = job.current_gpu_type
                free[job.current_gpu_type] -= job.current_gpus
        for job in sorted(view.jobs, key=lambda j: (j.arrival_s, j.job_id)):
            if job.job_id in shares:
                continue
            k = job.requested_gpus
            order = self.types or tuple(
                sorted(free, key=lambda t: -job.throughput_by_type.get(t, job.throughput)[k])
            )
            for t in order:
                if free.get(t, 0) >= k:
                    shares[job.job_id] = k
                    gpu_types[job.job_id] = t
                    free[t] -= k
                    break
        return Decision(shares=shares, gpu_types=gpu_types)


class ToyGreedy:
    """Throughput-aware: add GPUs one at a time where the relative gain is largest.

    A job gets another GPU while ``throughput[k + 1] / throughput[k] >= min_gain``; GPUs
    no job gains enough from stay idle. Records every view's curves in ``seen``.
    """

    name = "toy-greedy"
    elastic = True

    def __init__(self, min_gain: float = 1.05) -> None:
        self.min_gain = min_gain
        self.seen: list[tuple[float, dict[str, tuple[float, ...]]]] = []

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        self.seen.append((view.now_s, {j.job_id: j.throughput for j in view.jobs}))
        shares = {j.job_id: 0 for j in view.jobs}
        jobs = {j.job_id: j for j in view.jobs}
        free = view.total_gpus
        while free > 0:
            best, best_gain = None, self.min_gain
            for job_id in sorted(shares):
                k, job = shares[job_id], jobs[job_id]
                if k >= job.max_gpus:
                    continue
                gain = job.throughput[k + 1] / job.throughput[k] if k else float("inf")
                if gain >= best_gain:
                    best, best_gain = job_id, gain
            if best is None:
                break
            shares[best] += 1
            free -= 1
        return Decision(shares={j: k for j, k in shares.items() if k})

"""A policy run by the simulator and checked at every decision against a reference.

The policies that keep something between decisions (records, rankings, memos) are
checked this way: one instance as the simulator runs it, and at each decision a
reference decision for the same view and memory (a fresh instance, or the policy's
every-job form)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shoal.policies.base import ClusterView, Decision
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import load_workload

Check = Callable[[ClusterView, Mapping[str, Any], Decision], None]
"""``check(view, memory, decision)``: raise unless ``decision`` is the reference's."""


class CheckedAtEveryDecision:
    """``kept`` as the simulator runs it, each decision put through ``check``.

    Counts the decisions, the jobs started (given GPUs while holding none) and the jobs
    resized (holding GPUs and given another count), so a test can require that a run
    exercised what it checks."""

    def __init__(self, kept: Any, check: Check) -> None:
        self.kept = kept
        self.check = check
        self.decisions = 0
        self.started = 0
        self.resized = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.kept, attr)

    def decide(self, v: ClusterView, memory: Mapping[str, Any]) -> Decision:
        d = self.kept.decide(v, memory)
        self.check(v, memory, d)
        self.decisions += 1
        for j in v.jobs:
            if not j.current_gpus:
                self.started += bool(d.shares.get(j.job_id))
            elif d.shares.get(j.job_id, j.current_gpus) != j.current_gpus:
                self.resized += 1
        return d


def run_checked(kept: Any, check: Check, trace: str, flat: bool) -> CheckedAtEveryDecision:
    """Simulate the Philly prefix ``trace`` (seed 0) with ``kept`` checked at every decision."""
    policy = CheckedAtEveryDecision(kept, check)
    Simulator(load_workload(trace, seed=0), policy, SimConfig(flat=flat, retain_log=False)).run()
    return policy

"""Run a policy × trace matrix of simulations in parallel processes.

Each cell is a :class:`RunSpec` (plain data, so it crosses process boundaries) and
comes back as a :class:`RunOutcome`: the summary, the sorted JCTs (for CDFs), the
QL/CE/BI series at a few hundred instants (for AFS Figure 2-style plots), how long
loading and simulating took on the wall clock, and an error or a timeout instead of
a result when the cell failed. A failing cell never stops the others.

``cpu_limit_s`` bounds one cell's simulation time in CPU seconds of its process (on a
shared machine wall-clock time says more about the neighbours than about the run):
the policy is wrapped so that a decision after the limit raises :class:`RunTimeout`; the outcome then records how
far the run got (jobs completed, virtual time reached) so a report can say so rather
than drop the cell silently.

Workers: ``workers == 1`` runs the cells one after another in this process; more use
a :class:`concurrent.futures.ProcessPoolExecutor` (one cell per task, results in
submission order).
"""

from __future__ import annotations

import concurrent.futures
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from msgspec import Struct

from shoal.policies.base import ClusterView, Decision, Policy
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.sim.report import jcts


class RunTimeout(RuntimeError):
    """A cell ran past its CPU-time limit."""


class RunSpec(Struct, frozen=True, kw_only=True):
    """One cell of a matrix: a workload, a policy and a cluster."""

    trace: str
    """Workload spec for :func:`shoal.workloads.load_workload` (e.g. ``philly:2869ce``)."""
    policy: str
    params: dict[str, Any] = {}
    seed: int = 0
    config: SimConfig = SimConfig()
    limit: int | None = None
    """Keep only the first ``limit`` jobs of the workload."""
    cap_at_request: bool = False
    cpu_limit_s: float | None = None
    """Stop the cell after this many CPU seconds of simulation."""
    label: str = ""
    """Column name in reports (default: the policy name)."""
    series_points: int = 400

    @property
    def name(self) -> str:
        """The label, or the policy name."""
        return self.label or self.policy


class RunOutcome(Struct, kw_only=True):
    """What one cell produced."""

    spec: RunSpec
    ok: bool
    error: str = ""
    timed_out: bool = False
    load_s: float = 0.0
    wall_s: float = 0.0
    """Wall-clock seconds of simulation (loading excluded)."""
    cpu_s: float = 0.0
    """CPU seconds of simulation in the process that ran it (robust to other load)."""
    jobs: int = 0
    completed: int = 0
    virtual_s: float = 0.0
    """Virtual time reached."""
    summary: dict[str, float] = {}
    jcts: list[float] = []
    series: dict[str, list[float]] = {}
    final_digest: str = ""


class _Deadline:
    """A policy that refuses to decide after a CPU-time deadline (forwards the rest)."""

    def __init__(self, policy: Policy, deadline: float) -> None:
        self._policy = policy
        self._deadline = deadline
        self.name = policy.name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._policy, attr)

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        if time.process_time() > self._deadline:
            raise RunTimeout("CPU-time limit reached")
        return self._policy.decide(view, memory)


def run_one(spec: RunSpec) -> RunOutcome:
    """Simulate one cell; errors and timeouts become part of the outcome."""
    from shoal.workloads import load_workload

    t0 = time.perf_counter()
    try:
        jobs = load_workload(spec.trace, seed=spec.seed, cap_at_request=spec.cap_at_request)
        if spec.limit is not None:
            jobs = jobs[: spec.limit]
        policy: Policy = make_policy(spec.policy, spec.params, seed=spec.seed)
    except Exception as exc:  # a bad cell is reported, the matrix goes on
        return RunOutcome(spec=spec, ok=False, error=f"{type(exc).__name__}: {exc}")
    t1 = time.perf_counter()
    if spec.cpu_limit_s is not None:
        policy = _Deadline(policy, time.process_time() + spec.cpu_limit_s)
    sim = Simulator(jobs, policy, spec.config, trace=spec.trace)
    base = RunOutcome(spec=spec, ok=False, load_s=t1 - t0, jobs=len(jobs))
    c1 = time.process_time()
    try:
        result = sim.run()
    except RunTimeout:
        base.timed_out = True
        base.error = f"stopped at the limit of {spec.cpu_limit_s:g} CPU seconds"
    except Exception as exc:
        base.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    else:
        base.ok = True
        base.summary = dict(result.summary)
        base.jcts = jcts(result)
        start = min((j.submit_time_s for j in jobs), default=0.0)
        end = start + result.summary["makespan_s"]
        base.series = result.series.resampled(spec.series_points, start, end)
        base.final_digest = result.final_digest
    base.wall_s = time.perf_counter() - t1
    base.cpu_s = time.process_time() - c1
    base.completed = sum(1 for j in sim.jobs.values() if j.finished_at is not None)
    base.virtual_s = sim.clock.now
    return base


def run_matrix(
    specs: Sequence[RunSpec],
    *,
    workers: int = 1,
    on_done: Callable[[RunOutcome], None] | None = None,
) -> list[RunOutcome]:
    """Run every cell, ``workers`` at a time; outcomes in the order of ``specs``.

    Args:
        specs: the cells.
        workers: parallel processes (1: in this process).
        on_done: called with each outcome as it finishes (progress reporting).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    outcomes: list[RunOutcome | None] = [None] * len(specs)
    if workers == 1 or len(specs) <= 1:
        for i, spec in enumerate(specs):
            outcomes[i] = run_one(spec)
            if on_done is not None:
                on_done(outcomes[i])  # type: ignore[arg-type]
    else:
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_one, spec): i for i, spec in enumerate(specs)}
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    outcome = future.result()
                except Exception as exc:  # the worker process died
                    outcome = RunOutcome(spec=specs[i], ok=False, error=f"{type(exc).__name__}: {exc}")
                outcomes[i] = outcome
                if on_done is not None:
                    on_done(outcome)
    return [o for o in outcomes if o is not None]

"""SideCar adaptive: reshaping down and up against the predicted makespan, with costs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.policies.base import ClusterView, Decision
from shoal.policies.sidecar import SideCarAdaptive
from shoal.sim.costs import get_costs
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import load_workload

from tests.policies.test_tiresias import assert_pure, job, view, views

PLATEAU = (0.0, 1.0, 1.9, 2.0, 2.0)


def test_incoming_job_is_reshaped_down_when_waiting_would_be_longer() -> None:
    # 4 GPUs; a rigid job holds 3 and finishes in 1000 s. The incoming job asks for 4:
    # on the 1 idle GPU it finishes in 400 s; waiting for 4 GPUs would end at 1000 + 100 s.
    rigid = job(
        "rigid", requested_gpus=3, max_gpus=3, elastic=False, current_gpus=3, remaining_iterations=3000.0
    )
    new = job("new", arrival_s=5.0, requested_gpus=4, max_gpus=4, remaining_iterations=400.0)
    d = SideCarAdaptive().decide(view(10.0, 4, rigid, new), {})
    assert d.shares == {"rigid": 3, "new": 1}
    # If the rigid job ends in 10 s, waiting (10 + 100 s) beats 400 s on one GPU.
    soon = job(
        "rigid", requested_gpus=3, max_gpus=3, elastic=False, current_gpus=3, remaining_iterations=30.0
    )
    d = SideCarAdaptive().decide(view(10.0, 4, soon, new), {})
    assert d.shares == {"rigid": 3}
    # Algorithm 1 as printed (no waiting option) starts it on the idle GPU regardless.
    d = SideCarAdaptive(consider_waiting=False).decide(view(10.0, 4, soon, new), {})
    assert d.shares == {"rigid": 3, "new": 1}


def test_a_running_job_is_reshaped_down_for_an_incoming_one_including_the_restart_cost() -> None:
    # big: 4000 iterations on a curve that plateaus at 2 it/s -> 2000 s on 4 GPUs,
    # 30 + 2000 s on 3 GPUs (restart cost 30 s). new: 400 iterations, linear.
    # Take 1 GPU: makespan 2030 s. Wait for big: 2000 + 100 = 2100 s. Take 2: 30 + 4000/1.9.
    big = job(
        "big", requested_gpus=4, max_gpus=4, throughput=PLATEAU, current_gpus=4, remaining_iterations=4000.0
    )
    new = job("new", arrival_s=5.0, requested_gpus=4, max_gpus=4, remaining_iterations=400.0)
    d = SideCarAdaptive(default_options="all").decide(view(10.0, 4, big, new), {})
    assert d.shares == {"big": 3, "new": 1}
    # With powers of two as the optional counts big can only drop to 2 (30 + 4000/1.9 s,
    # worse than waiting): new waits.
    assert SideCarAdaptive().decide(view(10.0, 4, big, new), {}).shares == {"big": 4}
    # A 200-s checkpoint-restart makes the shrink (2200 s) worse than waiting: new waits.
    slow = SideCarAdaptive(costs=get_costs("scale_in=200,scale_out=200"), default_options="all")
    assert slow.decide(view(10.0, 4, big, new), {}).shares == {"big": 4}


def test_only_optional_counts_and_one_victim() -> None:
    # Victims may only move to one of their optional counts (here 4 -> 2, not 3).
    big = job(
        "big",
        requested_gpus=4,
        max_gpus=4,
        allowed_gpu_counts=(2, 4),
        throughput=PLATEAU,
        current_gpus=4,
        remaining_iterations=4000.0,
    )
    new = job("new", arrival_s=5.0, requested_gpus=2, max_gpus=2, remaining_iterations=100.0)
    d = SideCarAdaptive(consider_waiting=False).decide(view(10.0, 4, big, new), {})
    assert d.shares == {"big": 2, "new": 2}


def test_reshaping_up_when_gpus_are_idle_and_nothing_waits() -> None:
    lonely = job("lonely", requested_gpus=1, max_gpus=4, current_gpus=1, remaining_iterations=10_000.0)
    d = SideCarAdaptive().decide(view(10.0, 4, lonely), {})
    assert d.shares == {"lonely": 4}  # 30 + 2500 s < 10000 s
    # When the restart costs more than it saves, nothing changes (compared with no change).
    costly = SideCarAdaptive(costs=get_costs("scale_out=1e6"))
    assert costly.decide(view(10.0, 4, lonely), {}).shares == {"lonely": 1}


def test_no_reshaping_up_while_a_job_waits() -> None:
    # A rigid job needing 3 cannot start on 2 idle GPUs: it waits, so the runner is not grown.
    runner = job("runner", requested_gpus=2, max_gpus=4, current_gpus=2, remaining_iterations=1e5)
    rigid = job(
        "rigid", arrival_s=1.0, requested_gpus=3, max_gpus=3, elastic=False, remaining_iterations=100.0
    )
    d = SideCarAdaptive().decide(view(10.0, 4, runner, rigid), {})
    assert d.shares == {"runner": 2}


def test_a_job_that_can_never_fit_does_not_block_reshaping_up() -> None:
    lonely = job("lonely", requested_gpus=1, max_gpus=4, current_gpus=1, remaining_iterations=10_000.0)
    huge = job("huge", requested_gpus=8, max_gpus=8, elastic=False, remaining_iterations=10.0)
    assert SideCarAdaptive().decide(view(10.0, 4, lonely, huge), {}).shares == {"lonely": 4}


@settings(max_examples=60, deadline=None)
@given(views(), hs.sampled_from(["restart", "free", "coddl", "start=20,scale_in=5,scale_out=50"]))
def test_properties(v: ClusterView, costs: str) -> None:
    d = assert_pure(SideCarAdaptive(costs=costs), v)
    # SideCar never preempts a running job to zero.
    for j in v.jobs:
        if j.current_gpus and j.current_gpus <= v.total_gpus:
            assert d.shares.get(j.job_id, 0) > 0 or sum(x.current_gpus for x in v.jobs) > v.total_gpus


def test_runs_a_philly_prefix_to_completion() -> None:
    workload = load_workload("philly:2869ce:150", seed=0)
    summary = Simulator(workload, SideCarAdaptive(), SimConfig(flat=True)).run().summary
    assert summary["completed"] == summary["jobs"] == 150
    assert summary["preemptions"] == 0  # SideCar reshapes, it never preempts to zero


class KeptAndFresh:
    """A SideCar policy as the simulator runs it (one instance, which keeps what it read of
    each job's view from one decision to the next), checked at every decision against an
    instance made fresh (``make()``, bound to the same costs) that has seen nothing."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.kept = make()
        self.decisions = 0
        self.started = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.kept, attr)

    def decide(self, v: ClusterView, memory: Mapping[str, Any]) -> Decision:
        d = self.kept.decide(v, memory)
        fresh = self.make()
        if hasattr(fresh, "bind_costs"):
            fresh.bind_costs(self.kept.costs)
        assert fresh.decide(v, memory) == d
        self.decisions += 1
        self.started += sum(1 for j in v.jobs if not j.current_gpus and d.shares.get(j.job_id))
        return d


def assert_keeping_changes_no_decision(make: Callable[[], Any]) -> None:
    """Simulate two Philly prefixes with :class:`KeptAndFresh`: 6214e9's first jobs queue
    up behind long runners (hundreds wait at each decision), on the 16 x 4 topology; 2869ce
    on a flat pool."""
    for trace, flat in (("philly:6214e9:300", False), ("philly:2869ce:120", True)):
        policy = KeptAndFresh(make)
        Simulator(load_workload(trace, seed=0), policy, SimConfig(flat=flat, retain_log=False)).run()
        assert policy.decisions > 100 and policy.started > 50


def test_keeping_the_views_between_decisions_changes_no_decision() -> None:
    assert_keeping_changes_no_decision(SideCarAdaptive)
    # A view listing one job twice: each entry is a job of its own, as in a fresh instance.
    a = job("a", requested_gpus=2, max_gpus=4, remaining_iterations=100.0)
    b = job("b", arrival_s=1.0, requested_gpus=1, max_gpus=4, remaining_iterations=50.0)
    twice = view(5.0, 4, a, a, b)
    kept = SideCarAdaptive()
    first = kept.decide(twice, {})
    assert kept.decide(twice, {}) == first == SideCarAdaptive().decide(twice, {})

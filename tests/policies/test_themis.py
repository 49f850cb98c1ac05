"""Themis: worst finish-time fairness wins the offer, leases, leftovers, and properties."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from shoal.policies.base import ClusterView
from shoal.policies.themis import Themis
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import load_workload

from tests.policies.test_tiresias import assert_pure, job, view, views


def test_the_worst_rho_job_gets_the_offer() -> None:
    # One GPU, two waiting jobs of equal size; the one waiting longer has the worse ρ.
    policy = Themis(fairness_knob=0.5)
    early = job("early", arrival_s=0.0, remaining_iterations=100.0, total_iterations=100.0)
    late = job("late", arrival_s=900.0, remaining_iterations=100.0, total_iterations=100.0)
    d = policy.decide(view(1000.0, 1, late, early), {})
    assert d.shares == {"early": 1}


def test_rho_uses_the_contention_and_the_peak_throughput() -> None:
    # a: 1000 iterations at 10 it/s peak (4 GPUs), alone so far (N_avg = 1) -> T_id = 100 s.
    # b: 1000 iterations at 40 it/s peak, seen with 3 jobs on average -> T_id = 75 s.
    # Both hold one GPU now; a's ρ = (100 + 1000/4)/100 = 3.5, b's = (100 + 1000/10)/75 = 2.67.
    curve_a = (0.0, 4.0, 7.0, 9.0, 10.0)
    curve_b = (0.0, 10.0, 20.0, 30.0, 40.0)
    a = job(
        "a",
        arrival_s=0.0,
        max_gpus=4,
        throughput=curve_a,
        remaining_iterations=1000.0,
        total_iterations=1000.0,
    )
    b = job(
        "b",
        arrival_s=0.0,
        max_gpus=4,
        throughput=curve_b,
        remaining_iterations=1000.0,
        total_iterations=1000.0,
    )
    memory = {
        "contention": 0.0,
        "t": 0.0,
        "n": 2,
        "jobs": {"a": [100.0, 0.0, 1e9], "b": [-100.0, 0.0, 1e9]},  # leases not over
    }
    policy = Themis(fairness_knob=0.5, lease_s=10_000.0)
    # Both keep their leased GPU; the single free GPU goes to a (worst ρ).
    running = [msgspec.structs.replace(a, current_gpus=1), msgspec.structs.replace(b, current_gpus=1)]
    d = policy.decide(view(100.0, 3, *running), memory)
    assert d.shares == {"a": 2, "b": 1}
    assert d.memory["contention"] == pytest.approx(200.0)  # 2 jobs × 100 s


def test_a_lease_holds_until_it_ends() -> None:
    policy = Themis(fairness_knob=0.5, lease_s=600.0)
    holder = job("holder", arrival_s=0.0, remaining_iterations=1e6, total_iterations=1e6, current_gpus=1)
    waiter = job("waiter", arrival_s=0.0, remaining_iterations=10.0, total_iterations=10.0)
    memory = {"contention": 0.0, "t": 0.0, "n": 2, "jobs": {"holder": [0.0, 0.0, 600.0]}}
    d = policy.decide(view(300.0, 1, holder, waiter), memory)
    assert d.shares == {"holder": 1}  # lease not over: the waiter waits
    assert d.memory["next_decision_at_s"] == 600.0  # re-run when the lease ends
    assert d.memory["jobs"]["holder"][2] == 600.0  # an unchanged holding keeps its lease
    d = policy.decide(view(600.0, 1, holder, waiter), d.memory)
    assert d.shares == {"waiter": 1}  # lease over: ρ = ∞ without GPUs is the worst
    assert d.memory["jobs"]["waiter"][2] == 1200.0  # a fresh lease


def test_grid_leases_end_together_on_the_grid() -> None:
    policy = Themis(fairness_knob=0.5, lease_s=600.0, lease_grid=True)
    assert policy.tick_s == 600.0
    holder = job("holder", arrival_s=0.0, remaining_iterations=1e6, total_iterations=1e6, current_gpus=1)
    waiter = job("waiter", arrival_s=0.0, remaining_iterations=10.0, total_iterations=10.0)
    memory = {"round": 0, "contention": 0.0, "t": 0.0, "n": 2, "jobs": {}}
    d = policy.decide(view(300.0, 1, holder, waiter), memory)
    assert d.shares == {"holder": 1}
    d = policy.decide(view(600.0, 1, holder, waiter), d.memory)
    assert d.shares == {"waiter": 1}


def test_leftover_goes_to_the_other_jobs() -> None:
    # The one bidder can use 1 GPU only; the other 3 GPUs go to the non-bidders.
    policy = Themis(fairness_knob=0.5)
    bidder = job("bidder", arrival_s=0.0, remaining_iterations=100.0, total_iterations=100.0)
    others = [
        job(f"o{i}", arrival_s=500.0, max_gpus=2, remaining_iterations=100.0, total_iterations=100.0)
        for i in range(2)
    ]
    d = policy.decide(view(1000.0, 4, bidder, *others), {})
    assert d.shares["bidder"] == 1
    assert sum(d.shares.values()) == 4
    assert d.shares["o0"] >= 1 and d.shares["o1"] >= 1


def test_hidden_payment_feeds_the_leftover() -> None:
    # a and b (waiting since t=0) bid; c (just arrived) does not. The greedy gives a and b
    # 2 GPUs each. PA's payment: without a, b would take a third GPU and its T_sh would
    # fall from 100 + 400/2 to 100 + 400/3 s, so a keeps exp(-ln(300/233.3)) × 2 = 1.56
    # GPUs -> 1; the same for b. The two withheld GPUs go to c.
    a, b = (
        job(n, arrival_s=0.0, max_gpus=4, remaining_iterations=400.0, total_iterations=400.0) for n in "ab"
    )
    c = job("c", arrival_s=100.0, max_gpus=2, remaining_iterations=400.0, total_iterations=400.0)
    d = Themis(fairness_knob=0.5).decide(view(100.0, 4, a, b, c), {})
    assert d.shares == {"a": 1, "b": 1, "c": 2}
    d = Themis(fairness_knob=0.5, hidden_payment=False).decide(view(100.0, 4, a, b, c), {})
    assert d.shares == {"a": 2, "b": 2}


def test_cap_at_request() -> None:
    j = job("j", requested_gpus=2, max_gpus=8, remaining_iterations=100.0, total_iterations=100.0)
    assert Themis(cap_at_request=True).decide(view(0.0, 8, j), {}).shares == {"j": 2}
    assert Themis().decide(view(0.0, 8, j), {}).shares == {"j": 8}


@settings(max_examples=60, deadline=None)
@given(views())
def test_properties(v: ClusterView) -> None:
    assert_pure(Themis(lease_s=100.0), v)


def test_runs_a_philly_prefix_to_completion() -> None:
    workload = load_workload("philly:2869ce:150", seed=0)
    summary = Simulator(workload, Themis(), SimConfig(flat=True)).run().summary
    assert summary["completed"] == summary["jobs"] == 150
    # The leftover order is seeded: a second run decides exactly the same.
    assert Simulator(workload, Themis(), SimConfig(flat=True)).run().summary == summary


def test_the_length_unaware_variant_is_themis_without_lengths() -> None:
    """``themis-unaware`` shows its Themis the view with every length unknown, and
    nothing else changed; its decision is Themis' on that view."""
    from shoal.policies.base import Decision
    from shoal.policies.registry import get_policy
    from shoal.policies.unaware import LengthUnaware

    long_ = job(
        "long", arrival_s=0.0, iterations_done=100.0, remaining_iterations=10_000.0, total_iterations=10_100.0
    )
    short = job(
        "short", arrival_s=50.0, iterations_done=10.0, remaining_iterations=10.0, total_iterations=20.0
    )
    v = view(100.0, 1, long_, short)
    blind = msgspec.structs.replace(
        v,
        jobs=tuple(
            msgspec.structs.replace(j, remaining_iterations=None, total_iterations=None) for j in v.jobs
        ),
    )
    seen: list[ClusterView] = []

    class Spy:
        name = "spy"

        def decide(self, view: ClusterView, memory: object) -> Decision:
            seen.append(view)
            return Decision(shares={"short": 1}, memory={"m": 1})

    assert LengthUnaware(Spy(), "spy-unaware").decide(v, {}) == Decision(shares={"short": 1}, memory={"m": 1})
    assert seen == [blind]
    unaware = get_policy("themis-unaware", fairness_knob=0.5)
    assert unaware.decide(v, {}) == Themis(fairness_knob=0.5).decide(blind, {})
    grid = get_policy("themis-unaware", lease_s=300.0, lease_grid=True)
    assert grid.tick_s == 300.0  # type: ignore[attr-defined]  # the simulator's re-run grid

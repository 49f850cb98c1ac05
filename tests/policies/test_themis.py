"""Themis: worst finish-time fairness wins the offer, leases, leftovers, and properties."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.policies.base import ClusterView, Decision, JobView
from shoal.policies.themis import Themis
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import load_workload

from tests.policies.checked import run_checked
from tests.policies.test_tiresias import assert_pure, job, next_view, view, views


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


def _advance(v: ClusterView, d: Decision, dt: float, data: hs.DataObject, gone: list[JobView]) -> ClusterView:
    """The view ``dt`` later, as the simulator builds it: a job that waits keeps its view
    object; sometimes a job leaves (into ``gone``), one comes back as it was, or one (maybe
    a twin of another) arrives; sometimes a share is not placed."""
    moved = next_view(v, d, dt)
    jobs = [
        old if not old.current_gpus and not d.shares.get(old.job_id) else new
        for old, new in zip(v.jobs, moved.jobs, strict=True)
    ]
    if jobs and data.draw(hs.booleans()):
        gone.append(jobs.pop(data.draw(hs.integers(0, len(jobs) - 1))))
    if gone and not gone[0].current_gpus and data.draw(hs.booleans()):
        back = gone.pop(0)
        if back.job_id not in {j.job_id for j in jobs}:
            jobs.append(back)
    if jobs and data.draw(hs.booleans()):  # a share that was not placed: no GPUs after all
        i = data.draw(hs.integers(0, len(jobs) - 1))
        jobs[i] = msgspec.structs.replace(jobs[i], current_gpus=0)
    if data.draw(hs.booleans()):
        model = data.draw(hs.sampled_from(jobs)) if jobs else job("x")
        arrival = model.arrival_s if data.draw(hs.booleans()) else moved.now_s
        jobs.append(
            msgspec.structs.replace(
                model,
                job_id=next(f"n{i}" for i in itertools.count() if f"n{i}" not in {j.job_id for j in jobs}),
                arrival_s=arrival,
                current_gpus=0,
                attained_service_gpu_s=0.0,
            )
        )
    if v.arrival_ordered:
        jobs.sort(key=lambda j: (j.arrival_s, j.job_id))
    return ClusterView(
        now_s=moved.now_s, total_gpus=v.total_gpus, jobs=tuple(jobs), arrival_ordered=v.arrival_ordered
    )


@settings(max_examples=150, deadline=None)
@given(views(max_jobs=14), hs.data())
def test_ranking_by_columns_decides_as_decide_all(v: ClusterView, data: hs.DataObject) -> None:
    """decide (ρ of every job from kept columns, the auction walked only as far as GPUs
    go) equals decide_all (a working record for every job), decision and memory, over
    rounds where waiting jobs keep their view objects and memory is passed on or decoded;
    below ``columns_from_jobs`` it is decide_all's byte for byte."""
    kw = data.draw(
        hs.fixed_dictionaries(
            {
                "fairness_knob": hs.sampled_from([0.0, 0.5, 0.8]),
                "lease_s": hs.sampled_from([100.0, 600.0]),
                "cap_at_request": hs.booleans(),
                "hidden_payment": hs.booleans(),
                "lease_grid": hs.booleans(),
            }
        )
    )
    if data.draw(hs.booleans()):
        v = ClusterView(
            now_s=v.now_s,
            total_gpus=v.total_gpus,
            jobs=tuple(sorted(v.jobs, key=lambda j: (j.arrival_s, j.job_id))),
            arrival_ordered=True,
        )
    fast, reference = Themis(**kw), Themis(**kw)
    fast.ranks_from_jobs = 0  # the columns rank even a few jobs
    # Written in the column form's order, or (below columns_from_jobs) in decide_all's.
    plain = data.draw(hs.booleans())
    fast.columns_from_jobs = 10**9 if plain else 0
    fast.reads_lengths = reference.reads_lengths = data.draw(hs.booleans())
    memory: dict = {}
    ref_memory: dict = {}
    gone: list[JobView] = []
    for _ in range(4):
        d = fast.decide(v, memory)
        want = reference.decide_all(v, ref_memory)
        assert d == want
        if plain:  # the same bytes: the mappings in the same order
            assert msgspec.msgpack.encode(d) == msgspec.msgpack.encode(want)
        memory, ref_memory = d.memory, want.memory
        if data.draw(hs.booleans()):  # as if decoded from the log: another object
            memory = msgspec.msgpack.decode(msgspec.msgpack.encode(memory))
            ref_memory = msgspec.msgpack.decode(msgspec.msgpack.encode(ref_memory))
        v = _advance(v, d, data.draw(hs.sampled_from([0.0, 50.0, 100.0, 700.0])), data, gone)


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


def test_the_kept_columns_decide_as_decide_all_through_a_long_queue() -> None:
    """b436b2's first 300 jobs (an overloaded VC: a long queue) on the 16 x 4 topology,
    with the bands of :meth:`Themis.decide` lowered so that all three run many times
    (decide_all below 32 jobs, the columns written in decide_all's order up to 96, the
    column form's order from 96), with the columns kept from one decision to the next.
    Every decision equals decide_all's, and in the two lower bands it is the same bytes."""
    kept, reference = Themis(), Themis()
    kept.ranks_from_jobs, kept.columns_from_jobs = 32, 96
    bands = [0, 0, 0]

    def against_decide_all(v: ClusterView, memory: Mapping[str, Any], d: Decision) -> None:
        want = reference.decide_all(v, memory)
        assert d == want
        n = len(v.jobs)
        band = 0 if n < kept.ranks_from_jobs else 1 if n < kept.columns_from_jobs else 2
        bands[band] += 1
        if band < 2:
            assert msgspec.msgpack.encode(d) == msgspec.msgpack.encode(want)

    policy = run_checked(kept, against_decide_all, "philly:b436b2:300", False)
    assert policy.decisions > 1000 and policy.started > 300 and policy.resized > 100
    assert min(bands) > 100, bands

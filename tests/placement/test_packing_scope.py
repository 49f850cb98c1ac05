"""Network packing applies only where it belongs (issue 23, point 1).

Elastic policies (``Policy.elastic``) have their shares regulated (AFS appendix E);
rigid policies (FIFO, SRTF, SRSF, Tiresias-L, Gandiva_fair) publish whole gangs as
they decided them, and a rigid job keeps its size under every policy. All through the
path the allocator, placer and simulator share: :func:`shoal.allocation.decide_shares`
then :func:`shoal.allocation.place`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal import events as ev
from shoal.allocation import decide_shares, place
from shoal.fairness.policy import GandivaFairPolicy
from shoal.models import ThroughputCurve
from shoal.placement import Topology
from shoal.policies.afs import AFSL
from shoal.policies.base import ClusterView, JobView, policy_is_elastic
from shoal.policies.registry import policy_names
from shoal.policies.srtf import SRTF
from shoal.profiling.overestimate import decide_overestimate_first
from shoal.sim import SimConfig, Simulator
from shoal.sim.engine import make_policy
from shoal.workloads import make_job

RIGID = ("fifo", "srtf", "srsf", "tiresias-l", "gandiva-fair")


def _linear(n: int) -> tuple[float, ...]:
    return tuple(float(k) for k in range(n + 1))


def test_policies_say_whether_they_are_elastic() -> None:
    for name in policy_names():
        assert policy_is_elastic(make_policy(name)) is (name not in RIGID), name


def test_gandiva_fair_three_gpu_gang_on_four_gpu_servers_completes() -> None:
    # Issue 23: the 3-GPU gang was regulated to 0 for ever (SimulationStalled) and its
    # GPUs went to a 1-GPU job, which then ran above its gang size.
    curve = ThroughputCurve(model="m", gpu_type="gpu", throughput=_linear(8))
    jobs = [make_job(f"j{i}", 0.0, 600.0, s, curve, elastic=False) for i, s in enumerate((3, 1, 1))]
    sim = Simulator(jobs, GandivaFairPolicy(), SimConfig(total_gpus=4, gpus_per_node=4))
    result = sim.run()
    assert result.summary["completed"] == 3
    request = {j.job_id: j.spec.requested_gpus for j in jobs}
    for env in sim.log.envelopes:
        if isinstance(env.event, ev.PlacementDecided):
            assert {j: len(g) for j, g in env.event.placements.items()} == {
                j: request[j] for j in env.event.placements
            }


def test_srtf_is_not_reshaped_by_network_packing() -> None:
    jobs = tuple(
        JobView(job_id=f"j{i}", requested_gpus=s, max_gpus=8, throughput=_linear(8), remaining_iterations=r)
        for i, (s, r) in enumerate(((6, 100.0), (1, 200.0), (1, 300.0)))
    )
    view = ClusterView(now_s=0.0, total_gpus=8, gpus_per_node=4, jobs=jobs)
    shares = decide_shares(SRTF(), view, {}, epoch=1)
    assert shares.shares == {"j0": 6, "j1": 1, "j2": 1}
    placed, result = place(Topology.homogeneous(2, 4), shares, {})
    assert not result.unplaced
    assert {j: len(g) for j, g in placed.placements.items()} == {"j0": 6, "j1": 1, "j2": 1}


def test_a_rigid_job_under_an_elastic_policy_keeps_its_size() -> None:
    # AFS-L regulates, but a rigid 3-GPU job on 4-GPU servers keeps 3 (keep_unregulable)
    # instead of 0 for ever; the elastic job is still regulated.
    jobs = (
        JobView(
            job_id="rigid",
            requested_gpus=3,
            min_gpus=3,
            max_gpus=3,
            elastic=False,
            throughput=_linear(3),
            remaining_iterations=10.0,
        ),
        JobView(job_id="e", requested_gpus=1, max_gpus=8, throughput=_linear(8), remaining_iterations=1e6),
    )
    view = ClusterView(now_s=0.0, total_gpus=8, gpus_per_node=4, jobs=jobs)
    shares = decide_shares(AFSL(), view, {}, epoch=1)
    assert shares.shares["rigid"] == 3
    placed, _ = place(Topology.homogeneous(2, 4), shares, {})
    assert len(placed.placements["rigid"]) == 3


@hs.composite
def _views(draw: hs.DrawFn) -> ClusterView:
    g = draw(hs.sampled_from((2, 4, 8)))
    nodes = draw(hs.integers(1, 3))
    total = g * nodes
    jobs = []
    for i in range(draw(hs.integers(1, 6))):
        request = draw(hs.integers(1, total))
        elastic = draw(hs.booleans())
        top = draw(hs.integers(request, total)) if elastic else request
        jobs.append(
            JobView(
                job_id=f"j{i}",
                user=draw(hs.sampled_from(("u1", "u2"))),
                arrival_s=float(i),
                requested_gpus=request,
                min_gpus=1 if elastic else request,
                max_gpus=top,
                elastic=elastic,
                throughput=tuple(k**0.8 for k in range(top + 1)),
                remaining_iterations=float(draw(hs.integers(1, 10_000))),
                total_iterations=10_000.0,
            )
        )
    return ClusterView(now_s=0.0, total_gpus=total, gpus_per_node=g, jobs=tuple(jobs), arrival_ordered=True)


@settings(max_examples=40, deadline=None)
@given(view=_views(), name=hs.sampled_from(policy_names()))
def test_no_rigid_job_ever_runs_at_another_size(view: ClusterView, name: str) -> None:
    policy = make_policy(name)
    topology = Topology.homogeneous(view.total_gpus // view.gpus_per_node, view.gpus_per_node)
    jobs = {j.job_id: j for j in view.jobs}
    raw = policy.decide(view, {}).shares
    shares = decide_shares(policy, view, {}, epoch=1)
    placed, _ = place(topology, shares, {})
    for job_id, gpus in placed.placements.items():
        # A gang is placed whole or not at all.
        assert len(gpus) == shares.shares[job_id]
        if not jobs[job_id].elastic or not policy_is_elastic(policy):
            assert len(gpus) == jobs[job_id].requested_gpus, (name, job_id)
    if not policy_is_elastic(policy):
        # A rigid policy's decision is published as it made it.
        assert shares.shares == {j: s for j, s in raw.items() if s > 0}


@settings(max_examples=40, deadline=None)
@given(
    view=_views(),
    name=hs.sampled_from(RIGID),
    measured=hs.lists(hs.integers(1, 24), max_size=3),
)
def test_overestimate_first_leaves_a_rigid_policys_gangs_as_decided(
    view: ClusterView, name: str, measured: list[int]
) -> None:
    # AFS §4.5 caps a new job at 1/n and probes smaller units: both resize a job, which
    # a rigid policy never does (review of issue 23: SRTF ran a 16-GPU job at 1, 2, 4...).
    policy = make_policy(name)
    estimates = {j.job_id: frozenset(m for m in measured if m <= j.max_gpus) for j in view.jobs}
    probed = decide_overestimate_first(policy, view, {}, estimates=estimates, epoch=1)
    assert probed.shares == decide_shares(policy, view, {}, epoch=1).shares


@pytest.mark.parametrize("name", ["srtf", "tiresias-l", "fifo"])
def test_a_rigid_policy_runs_elastic_flagged_jobs_at_their_size_while_they_are_measured(name: str) -> None:
    curve = ThroughputCurve(model="m", gpu_type="gpu", throughput=tuple(k**0.7 for k in range(17)))
    jobs = [make_job(f"j{i}", 60.0 * i, 3600.0, 16, curve, elastic=True) for i in range(3)]
    sim = Simulator(
        jobs, make_policy(name), SimConfig(total_gpus=64, gpus_per_node=8, profiling="overestimate")
    )
    assert sim.run().summary["completed"] == 3
    sizes = {
        s
        for env in sim.log.envelopes
        if isinstance(env.event, ev.SharesDecided)
        for s in env.event.shares.values()
    }
    assert sizes == {16}, sizes

"""The placers' and the packer's memos change nothing.

The cluster placers reuse the index of the last topology they were given
(``shoal.placement._cluster``), regulation shares :class:`_Feasible` records between
jobs of the same shape, and :func:`shoal.allocation.pack_shares` only looks up the
feasible counts of jobs with a positive share. Each test replays random churn (a
series of placements, each from the last one's result) on one topology object and
compares with a fresh, equal topology per call (no reuse possible), or with the
definition.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.allocation import pack_shares
from shoal.events import GpuRef
from shoal.placement import Topology, place_consolidated, place_min_migration, regulate_shares
from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts

from tests.placement.placement_strategies import scenario


def _fresh(topology: Topology) -> Topology:
    return msgspec.convert(msgspec.to_builtins(topology), Topology)


@settings(max_examples=60, deadline=None)
@given(
    scenario(),
    st.lists(st.dictionaries(st.sampled_from([f"j{i}" for i in range(8)]), st.integers(0, 10)), max_size=5),
)
def test_churn_on_one_topology_equals_fresh_topologies(sc, rounds) -> None:
    topo, shares, previous, types = sc
    prev_reused: dict[str, tuple[GpuRef, ...]] = dict(previous)
    prev_fresh: dict[str, tuple[GpuRef, ...]] = dict(previous)
    for step in [shares, *rounds]:
        for placer in (place_min_migration, place_consolidated):
            reused = placer(topo, step, prev_reused, types)
            fresh = placer(_fresh(topo), step, prev_fresh, types)
            assert reused == fresh
        prev_reused = dict(reused.placements)
        prev_fresh = dict(fresh.placements)


@st.composite
def _view_and_shares(draw: st.DrawFn) -> tuple[ClusterView, Decision]:
    jobs = []
    shares = {}
    for i in range(draw(st.integers(0, 10))):
        lo = draw(st.integers(1, 8))
        hi = draw(st.integers(lo, 16))
        allowed = draw(
            st.none()
            | st.lists(st.integers(1, 16), min_size=1, max_size=5).map(lambda x: tuple(sorted(set(x))))
        )
        job = JobView(
            job_id=f"j{i}",
            min_gpus=lo,
            max_gpus=hi,
            requested_gpus=draw(st.integers(lo, hi)),
            elastic=draw(st.booleans()),
            allowed_gpu_counts=allowed,
        )
        jobs.append(job)
        counts = feasible_counts(job)
        if counts and draw(st.booleans()):
            shares[job.job_id] = draw(st.sampled_from(counts))
        elif draw(st.booleans()):
            shares[job.job_id] = 0
    view = ClusterView(
        now_s=0.0, total_gpus=draw(st.sampled_from([16, 32, 64])), jobs=tuple(jobs), gpus_per_node=4
    )
    return view, Decision(shares=shares)


@settings(max_examples=200, deadline=None)
@given(_view_and_shares())
def test_pack_shares_equals_regulation_with_every_jobs_counts(case) -> None:
    view, decision = case
    every = {j.job_id: feasible_counts(j) for j in view.jobs}
    want = regulate_shares(decision.shares, every, view.gpus_per_node, view.total_gpus, keep_unregulable=True)
    assert pack_shares(view, decision).shares == want

"""Placement at cluster scale: every invariant on thousands of jobs (slow)."""

from __future__ import annotations

import random

import pytest
from shoal.placement import (
    Topology,
    check_placement,
    place_consolidated,
    place_min_migration,
    regulate_shares,
)


@pytest.mark.slow
@pytest.mark.parametrize("n_nodes,n_jobs", [(512, 1000), (2500, 5000)])
def test_churned_rounds_stay_valid_and_packed_at_scale(n_nodes: int, n_jobs: int) -> None:
    rng = random.Random(n_jobs)
    topo = Topology.homogeneous(n_nodes, 4)
    total = topo.total_gpus
    previous: dict = {}  # type: ignore[type-arg]
    jobs = [f"j{i}" for i in range(n_jobs)]
    for round_ in range(4):
        plan = {j: rng.choice([1, 1, 2, 3, 4, 6, 8, 16]) for j in jobs}
        scale = total / sum(plan.values())
        plan = {j: max(1, int(s * scale)) for j, s in plan.items()}
        shares = {j: s for j, s in regulate_shares(plan, {}, 4, total).items() if s}
        p = place_min_migration(topo, shares, previous, allow_split=False)
        check_placement(topo, shares, p)
        assert p.unplaced == {}  # AFS appendix E, Proposition 1, at scale
        q = place_consolidated(topo, shares, previous)
        check_placement(topo, shares, q)
        assert q.unplaced == {}
        previous = p.placements
        jobs = jobs[n_jobs // 10 :] + [f"r{round_}x{i}" for i in range(n_jobs // 10)]

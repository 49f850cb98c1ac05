"""Consolidating placement (Optimus §4.2, Theorem 1)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from placement_strategies import scenario
from shoal.events import GpuRef
from shoal.placement import (
    NodeSlots,
    Topology,
    check_placement,
    count_migrations,
    nodes_used,
    place_consolidated,
)


def gpus(node: str, *indices: int) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(node, i) for i in indices)


def test_a_job_bigger_than_a_node_uses_the_fewest_nodes() -> None:
    topo = Topology.homogeneous(3, 4)
    p = place_consolidated(topo, {"a": 6}, {})
    assert nodes_used(p.placements["a"]) == 2
    assert p.placements["a"] == gpus("n0", 0, 1, 2, 3) + gpus("n1", 0, 1)


def test_largest_first_and_most_available_server_first() -> None:
    # n0 has 2 usable GPUs, n1 has 4. The 4-GPU job is placed first, on n1; the 2s then
    # go to the most available server left, n0, and the last one has to split.
    topo = Topology(
        nodes=(NodeSlots(node_id="n0", gpu_indices=(0, 1)), NodeSlots(node_id="n1", gpu_indices=(0, 1, 2, 3)))
    )
    p = place_consolidated(topo, {"small": 2, "big": 4}, {})
    assert p.placements["big"] == gpus("n1", 0, 1, 2, 3)
    assert p.placements["small"] == gpus("n0", 0, 1)


def test_ties_prefer_the_jobs_previous_node_and_gpus() -> None:
    topo = Topology.homogeneous(3, 4)
    p = place_consolidated(topo, {"a": 2}, {"a": gpus("n2", 1, 3)})
    assert p.placements["a"] == gpus("n2", 1, 3)
    assert p.migrations == 0


def test_too_few_gpus_of_the_type_leaves_the_job_unplaced() -> None:
    topo = Topology(
        nodes=(
            NodeSlots(node_id="k0", gpu_indices=(0, 1), gpu_type="K80"),
            NodeSlots(node_id="v0", gpu_indices=(0, 1, 2, 3), gpu_type="V100"),
        )
    )
    p = place_consolidated(topo, {"a": 3, "b": 1}, {}, {"a": "K80", "b": "K80"})
    assert p.unplaced == {"a": 3}
    assert p.placements["b"] == gpus("k0", 0)


@given(scenario())
@settings(max_examples=400, deadline=None)
def test_placement_is_always_valid(case) -> None:  # type: ignore[no-untyped-def]
    topo, shares, previous, types = case
    p = place_consolidated(topo, shares, previous, types)
    check_placement(topo, shares, p, types)
    assert p.migrations == count_migrations(previous, p.placements)


@given(scenario())
@settings(max_examples=400, deadline=None)
def test_every_job_gets_the_fewest_servers_left_when_its_turn_comes(case) -> None:  # type: ignore[no-untyped-def]
    # Theorem 1 as Optimus applies it greedily: replay the largest-first order and check that
    # each job spans the fewest nodes that could have held it given what was still free.
    topo, shares, previous, types = case
    p = place_consolidated(topo, shares, previous, types)
    free = {n.node_id: len(n.gpu_indices) for n in topo.nodes}
    ntype = {n.node_id: n.gpu_type for n in topo.nodes}
    for job in sorted((j for j in shares if shares[j] > 0), key=lambda j: (-shares[j], j)):
        if job not in p.placements:
            continue
        want = types.get(job, "")
        caps = sorted((f for nid, f in free.items() if not want or ntype[nid] == want), reverse=True)
        fewest, acc = 0, 0
        while acc < shares[job]:
            acc += caps[fewest]
            fewest += 1
        assert nodes_used(p.placements[job]) == fewest
        for g in p.placements[job]:
            free[g.node_id] -= 1


@given(st.integers(1, 8), st.sampled_from([2, 4, 8]), st.data())
@settings(max_examples=200, deadline=None)
def test_whole_node_multiples_take_whole_nodes(m: int, g: int, data: st.DataObject) -> None:
    topo = Topology.homogeneous(m, g)
    k = data.draw(st.integers(1, m))
    p = place_consolidated(topo, {"a": k * g}, {})
    nodes = {r.node_id for r in p.placements["a"]}
    assert len(nodes) == k


@given(scenario(), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_the_order_of_the_mappings_does_not_matter(case, rnd) -> None:  # type: ignore[no-untyped-def]
    topo, shares, previous, types = case

    def shuffled(d: dict) -> dict:  # type: ignore[type-arg]
        items = list(d.items())
        rnd.shuffle(items)
        return dict(items)

    a = place_consolidated(topo, shares, previous, types)
    b = place_consolidated(topo, shuffled(shares), shuffled(previous), shuffled(types))
    assert (a.placements, a.unplaced, a.migrations) == (b.placements, b.unplaced, b.migrations)

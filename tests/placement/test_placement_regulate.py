"""Network packing regulation (AFS appendix E): literal cases and Propositions 1 and 2."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from placement_strategies import scenario
from shoal.placement import (
    NodeSlots,
    Topology,
    check_placement,
    is_regulated,
    nodes_used,
    place_consolidated,
    place_min_migration,
    regulate_for_topology,
    regulate_shares,
    regulated_floor,
    sub_node_sizes,
)

# --- literal cases ---------------------------------------------------------------


def test_sub_node_sizes_follow_the_divisibility_chain() -> None:
    assert sub_node_sizes(4) == (1, 2)
    assert sub_node_sizes(8) == (1, 2, 4)
    assert sub_node_sizes(6) == (1, 2)
    assert sub_node_sizes(3) == (1,)
    assert sub_node_sizes(1) == ()


def test_regulated_floor_is_appendix_e_x_i() -> None:
    # x_i = floor(s/G)·G above a node, 2^floor(log2 s) below it, 0 for 0 (G = 4).
    assert [regulated_floor(s, 4) for s in range(11)] == [0, 1, 2, 2, 4, 4, 4, 4, 8, 8, 8]
    assert regulated_floor(7, 8) == 4
    assert regulated_floor(13, 1) == 13


def test_is_regulated() -> None:
    assert [s for s in range(13) if is_regulated(s, 4)] == [0, 1, 2, 4, 8, 12]
    assert not is_regulated(3, 4)
    assert is_regulated(3, 0)  # a flat pool regulates nothing


def test_rounding_frees_gpus_that_go_back_in_regulated_steps() -> None:
    # 16 GPUs on 4 × 4. Rounding down: a 3 -> 2, b 5 -> 4, c 6 -> 4, d 2 -> 2 frees 4 GPUs.
    # Deficits are then a 1, b 1, c 2, d 0: c is furthest below plan and steps 4 -> 8,
    # which uses all 4 spare GPUs.
    r = regulate_shares({"a": 3, "b": 5, "c": 6, "d": 2}, {}, gpus_per_node=4, total_gpus=16)
    assert r == {"a": 2, "b": 4, "c": 8, "d": 2}


def test_infeasible_regulated_size_gets_zero() -> None:
    # A non-elastic 3-GPU job cannot be regulated on 4-GPU nodes: it gets 0, and its
    # GPUs go to the others in regulated steps.
    r = regulate_shares({"rigid": 3, "e": 2}, {"rigid": (3,), "e": (1, 2, 3, 4, 5)}, 4, 8)
    assert r["rigid"] == 0
    assert r["e"] == 4


def test_feasible_counts_bound_the_result() -> None:
    r = regulate_shares({"a": 7}, {"a": (1, 2, 3)}, 4, 8)
    assert r == {"a": 2}  # 4 is regulated but not feasible, 3 is feasible but not regulated


def test_never_exceeds_total_gpus() -> None:
    # 17 planned on 12 GPUs: the largest shares are shaved first (ties by job id): a 8 -> 4,
    # still 13, then b 8 -> 4. The 3 GPUs left go to c in regulated steps 1 -> 2 -> 4.
    r = regulate_shares({"a": 8, "b": 8, "c": 1}, {}, 4, 12)
    assert r == {"a": 4, "b": 4, "c": 4}


def test_zero_share_never_receives_gpus() -> None:
    r = regulate_shares({"idle": 0, "a": 3}, {}, 4, 8)
    assert r["idle"] == 0
    assert r["a"] in (2, 4)


def test_flat_pool_only_clips_to_feasible() -> None:
    assert regulate_shares({"a": 3, "b": 5}, {"a": (1, 3)}, 0, 8) == {"a": 3, "b": 5}


# --- Proposition 2: feasibility and difference bound -------------------------------


@st.composite
def planned_shares(draw: st.DrawFn) -> tuple[int, int, dict[str, int]]:
    """G (a power of two), m nodes, and planned shares summing to exactly m·G."""
    g = draw(st.sampled_from([1, 2, 4, 8]))
    m = draw(st.integers(1, 12))
    total = g * m
    n = draw(st.integers(1, 20))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, total]
    shares = {f"j{i:02d}": bounds[i + 1] - bounds[i] for i in range(n)}
    return g, m, shares


@given(planned_shares())
@settings(max_examples=300, deadline=None)
def test_proposition_2_total_kept_and_floor_respected(case: tuple[int, int, dict[str, int]]) -> None:
    g, m, shares = case
    r = regulate_shares(shares, {}, g, g * m)
    assert set(r) == set(shares)
    assert sum(r.values()) == sum(shares.values())  # Prop. 2, first condition
    for job, s in shares.items():
        assert is_regulated(r[job], g)
        assert r[job] >= regulated_floor(s, g)  # Prop. 2, second condition
        if s == 0:
            assert r[job] == 0


@st.composite
def constrained_shares(draw: st.DrawFn) -> tuple[int, int, dict[str, int], dict[str, tuple[int, ...]]]:
    g = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    total = draw(st.integers(0, 64))
    n = draw(st.integers(1, 15))
    shares = {f"j{i:02d}": draw(st.integers(0, 40)) for i in range(n)}
    feasible = {
        j: tuple(draw(st.sets(st.integers(1, 40), min_size=1, max_size=8)))
        for j in shares
        if draw(st.booleans())
    }
    return g, total, shares, feasible


@given(constrained_shares())
@settings(max_examples=300, deadline=None)
def test_regulated_shares_are_feasible_regulated_and_within_capacity(
    case: tuple[int, int, dict[str, int], dict[str, tuple[int, ...]]],
) -> None:
    g, total, shares, feasible = case
    r = regulate_shares(shares, feasible, g, total)
    assert sum(r.values()) <= min(total, sum(shares.values()))
    for job, v in r.items():
        assert is_regulated(v, g)
        if v:
            assert shares[job] > 0
            if job in feasible:
                assert v in feasible[job]


# --- Proposition 1: regulated shares always pack -------------------------------------


@st.composite
def regulated_multiset(draw: st.DrawFn) -> tuple[int, int, dict[str, int]]:
    """Any multiset of regulated shares whose sum fits m nodes of G GPUs (G any size)."""
    g = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    m = draw(st.integers(1, 16))
    sizes = [*sub_node_sizes(g), *(g * k for k in range(1, m + 1))]
    left = g * m
    shares: dict[str, int] = {}
    for i in range(draw(st.integers(0, 30))):
        fitting = [s for s in sizes if s <= left]
        if not fitting:
            break
        s = draw(st.sampled_from(fitting))
        shares[f"j{i:02d}"] = s
        left -= s
    return g, m, shares


def _assert_network_packed(g: int, shares: dict[str, int], placements: dict) -> None:  # type: ignore[type-arg]
    for job, s in shares.items():
        gpus = placements[job]
        # Prop. 1, first condition: exactly ceil(r/G) machines.
        assert nodes_used(gpus) == -(-s // g)
    # Prop. 1, second condition: a machine hosting a multi-node job hosts nothing else.
    jobs_on: dict[str, set[str]] = {}
    for job, gpus in placements.items():
        for gpu in gpus:
            jobs_on.setdefault(gpu.node_id, set()).add(job)
    for node, jobs in jobs_on.items():
        multi = [j for j in jobs if nodes_used(placements[j]) > 1]
        assert len(multi) <= 1, node
        if multi:
            assert jobs == set(multi), node


@given(regulated_multiset())
@settings(max_examples=300, deadline=None)
def test_proposition_1_min_migration_packs_every_regulated_multiset(
    case: tuple[int, int, dict[str, int]],
) -> None:
    g, m, shares = case
    topo = Topology.homogeneous(m, g)
    p = place_min_migration(topo, shares, {}, allow_split=False)
    assert p.unplaced == {}
    check_placement(topo, shares, p)
    _assert_network_packed(g, shares, p.placements)


@given(regulated_multiset())
@settings(max_examples=300, deadline=None)
def test_proposition_1_consolidated_packs_every_regulated_multiset(
    case: tuple[int, int, dict[str, int]],
) -> None:
    g, m, shares = case
    topo = Topology.homogeneous(m, g)
    p = place_consolidated(topo, shares, {})
    assert p.unplaced == {}
    check_placement(topo, shares, p)
    _assert_network_packed(g, shares, p.placements)


@given(planned_shares())
@settings(max_examples=200, deadline=None)
def test_regulate_then_place_end_to_end(case: tuple[int, int, dict[str, int]]) -> None:
    # The whole chain of appendix E: arbitrary plan -> regulated -> packed, nothing left over.
    g, m, shares = case
    r = regulate_shares(shares, {}, g, g * m)
    topo = Topology.homogeneous(m, g)
    positive = {j: v for j, v in r.items() if v}
    p = place_min_migration(topo, positive, {}, allow_split=False)
    assert p.unplaced == {}
    assert sum(len(v) for v in p.placements.values()) == g * m
    _assert_network_packed(g, positive, p.placements)


# --- against a real topology ------------------------------------------------------------


def test_regulate_for_topology_uses_the_usable_node_size() -> None:
    # Each node has one GPU drained, so G = 3 and the sub-node sizes are just (1,): 4 -> 3
    # and 2 -> 1; the 2 spare GPUs lift b from 1 to 3 (a whole node).
    topo = Topology(
        nodes=(NodeSlots(node_id="n0", gpu_indices=(0, 1, 2)), NodeSlots(node_id="n1", gpu_indices=(1, 2, 3)))
    )
    r = regulate_for_topology({"a": 4, "b": 2}, {}, topo)
    assert r == {"a": 3, "b": 3}
    p = place_min_migration(topo, r, {}, allow_split=False)
    assert p.unplaced == {}


def test_regulate_for_topology_shrinks_what_does_not_pack() -> None:
    # Nodes of 4, 2 and 2 usable GPUs: two 4s fit the GPU count (8) but there is only one
    # whole node, so the packing check steps the second 4 (by job id) down to 2.
    topo = Topology(
        nodes=(
            NodeSlots(node_id="n0", gpu_indices=(0, 1, 2, 3)),
            NodeSlots(node_id="n1", gpu_indices=(0, 1)),
            NodeSlots(node_id="n2", gpu_indices=(2, 3)),
        )
    )
    assert regulate_shares({"a": 4, "b": 4}, {}, 4, 8) == {"a": 4, "b": 4}
    assert regulate_for_topology({"a": 4, "b": 4}, {}, topo) == {"a": 4, "b": 2}


def test_regulate_for_topology_works_per_gpu_type() -> None:
    topo = Topology(
        nodes=(
            *(NodeSlots(node_id=f"k{i}", gpu_indices=tuple(range(8)), gpu_type="K80") for i in range(2)),
            *(NodeSlots(node_id=f"v{i}", gpu_indices=tuple(range(4)), gpu_type="V100") for i in range(2)),
        )
    )
    types = {"k": "K80", "v": "V100"}
    r = regulate_for_topology({"k": 12, "v": 6, "free": 3}, {}, topo, types)
    # K80 nodes have 8 GPUs: 12 -> 8 (the 4 freed are less than a node). V100 nodes have 4:
    # 6 -> 4. The untyped job is regulated against the largest node (8): 3 -> 2.
    assert r == {"k": 8, "v": 4, "free": 2}


@given(scenario(), st.data())
@settings(max_examples=300, deadline=None)
def test_regulate_for_topology_always_packs(case, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    topo, shares, _, types = case
    feasible = {
        j: tuple(data.draw(st.sets(st.integers(1, 12), min_size=1, max_size=6), label=j))
        for j in shares
        if data.draw(st.booleans(), label=f"{j} restricted")
    }
    r = regulate_for_topology(shares, feasible, topo, types)
    assert set(r) == set(shares)
    positive = {j: v for j, v in r.items() if v}
    for job, v in positive.items():
        assert shares[job] > 0
        assert is_regulated(v, topo.gpus_per_node_of_type(types.get(job, "")))
        if job in feasible:
            assert v in feasible[job]
    p = place_min_migration(topo, positive, {}, types, allow_split=False)
    assert p.unplaced == {}
    check_placement(topo, positive, p, types)


def test_keep_unregulable_lets_a_rigid_job_run_unregulated() -> None:
    shares = {"rigid": 3, "e": 4}
    feasible = {"rigid": (3,)}
    assert regulate_shares(shares, feasible, 4, 8) == {"rigid": 0, "e": 4}
    r = regulate_shares(shares, feasible, 4, 8, keep_unregulable=True)
    assert r == {"rigid": 3, "e": 4}
    topo = Topology.homogeneous(2, 4)
    p = place_min_migration(topo, r, {}, allow_split=False)
    assert p.unplaced == {}
    assert nodes_used(p.placements["rigid"]) == 1

"""Min-migration placement (CoDDL §4.4): literal stories, then invariants under hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placement_strategies import scenario
from shoal.events import GpuRef
from shoal.placement import (
    NodeSlots,
    Placement,
    PlacementError,
    Topology,
    check_placement,
    count_migrations,
    is_regulated,
    nodes_used,
    place_min_migration,
    sub_node_sizes,
)


def gpus(node: str, *indices: int) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(node, i) for i in indices)


# --- stories --------------------------------------------------------------------------


def test_a_shrink_keeps_gpus() -> None:
    topo = Topology.homogeneous(2, 4)
    before = {"a": gpus("n0", 0, 1, 2, 3) + gpus("n1", 0, 1, 2, 3)}
    p = place_min_migration(topo, {"a": 2}, before)
    assert p.migrations == 0
    assert p.placements["a"] == gpus("n0", 0, 1)  # a subset of what it had, on one node


def test_an_expansion_keeps_old_gpus_and_adds_nearby_ones() -> None:
    topo = Topology.homogeneous(2, 4)
    before = {"a": gpus("n0", 2), "b": gpus("n1", 0, 1)}
    p = place_min_migration(topo, {"a": 2, "b": 2}, before)
    assert p.migrations == 0
    assert p.placements["a"] == gpus("n0", 1, 2)  # kept index 2, added its neighbour
    assert p.placements["b"] == before["b"]


def test_an_expansion_to_a_whole_node_keeps_its_node() -> None:
    topo = Topology.homogeneous(3, 4)
    before = {"a": gpus("n1", 0, 1), "b": gpus("n2", 0)}
    p = place_min_migration(topo, {"a": 4, "b": 1}, before)
    assert p.migrations == 0
    assert p.placements["a"] == gpus("n1", 0, 1, 2, 3)
    assert p.placements["b"] == before["b"]


def test_an_expansion_past_a_node_keeps_its_node_and_takes_a_free_one() -> None:
    topo = Topology.homogeneous(3, 4)
    before = {"a": gpus("n0", 0, 1, 2, 3), "b": gpus("n1", 0)}
    p = place_min_migration(topo, {"a": 8, "b": 1}, before)
    assert p.migrations == 0
    # n1 is wanted by b, so a's second node is the empty n2.
    assert p.placements["a"] == gpus("n0", 0, 1, 2, 3) + gpus("n2", 0, 1, 2, 3)
    assert p.placements["b"] == before["b"]


def test_a_new_big_job_forces_a_minimal_migration() -> None:
    # Two half-full nodes, and a newcomer needs a whole node: exactly one job moves, and it
    # moves onto the other half-full node; the other job does not move.
    topo = Topology.homogeneous(2, 4)
    before = {"a": gpus("n0", 0, 1), "b": gpus("n1", 2, 3)}
    p = place_min_migration(topo, {"a": 2, "b": 2, "new": 4}, before)
    check_placement(topo, {"a": 2, "b": 2, "new": 4}, p)
    assert p.migrations == 1
    assert p.unplaced == {}
    assert nodes_used(p.placements["new"]) == 1
    moved = [j for j in ("a", "b") if not set(p.placements[j]) & set(before[j])]
    assert len(moved) == 1
    stayed = "b" if moved == ["a"] else "a"
    assert p.placements[stayed] == before[stayed]


def test_a_new_job_lands_where_it_displaces_nobody() -> None:
    # n0 holds a; n1 is empty. The newcomer takes n1 although n0 also has room.
    topo = Topology.homogeneous(2, 4)
    before = {"a": gpus("n0", 0)}
    p = place_min_migration(topo, {"a": 1, "new": 4}, before)
    assert p.migrations == 0
    assert p.placements["new"] == gpus("n1", 0, 1, 2, 3)


def test_new_sub_node_job_avoids_gpus_a_smaller_job_will_keep() -> None:
    # n0: b holds GPU 0. A new 2-GPU job goes first (larger) and must not take GPU 0.
    topo = Topology.homogeneous(1, 4)
    before = {"b": gpus("n0", 0)}
    p = place_min_migration(topo, {"new": 2, "b": 1}, before)
    assert p.migrations == 0
    assert p.placements["b"] == before["b"]
    assert p.placements["new"] == gpus("n0", 1, 2)


def test_unchanged_shares_change_nothing() -> None:
    topo = Topology.homogeneous(4, 4)
    before = {
        "big": gpus("n0", 0, 1, 2, 3) + gpus("n1", 0, 1, 2, 3),
        "two": gpus("n2", 2, 3),
        "one": gpus("n2", 0),
        "four": gpus("n3", 0, 1, 2, 3),
    }
    shares = {j: len(g) for j, g in before.items()}
    p = place_min_migration(topo, shares, before)
    assert p.placements == before
    assert p.migrations == 0


def test_a_job_that_does_not_fit_is_unplaced_with_its_whole_share() -> None:
    topo = Topology.homogeneous(1, 4)
    p = place_min_migration(topo, {"a": 4, "b": 2}, {})
    assert p.placements.keys() == {"a"}
    assert p.unplaced == {"b": 2}
    check_placement(topo, {"a": 4, "b": 2}, p)


def test_zero_shares_are_dropped_and_negative_shares_rejected() -> None:
    topo = Topology.homogeneous(1, 4)
    p = place_min_migration(topo, {"a": 0}, {"a": gpus("n0", 0)})
    assert p == Placement(placements={}, migrations=0, unplaced={})
    with pytest.raises(PlacementError):
        place_min_migration(topo, {"a": -1}, {})


def test_drained_gpus_are_never_used_and_force_a_split_only_when_allowed() -> None:
    # Each node lost a GPU, so 3 usable each. Three 2-GPU jobs: the third fits only split 1 + 1.
    topo = Topology(
        nodes=(NodeSlots(node_id="n0", gpu_indices=(0, 1, 3)), NodeSlots(node_id="n1", gpu_indices=(1, 2, 3)))
    )
    shares = {"a": 2, "b": 2, "c": 2}
    packed = place_min_migration(topo, shares, {}, allow_split=False)
    check_placement(topo, shares, packed)
    assert packed.unplaced == {"c": 2}
    split = place_min_migration(topo, shares, {})
    check_placement(topo, shares, split)
    assert split.unplaced == {}
    assert nodes_used(split.placements["c"]) == 2


def test_node_size_is_the_largest_usable_node() -> None:
    # With every node down to 3 usable GPUs, a 4-GPU job takes one whole node plus one GPU:
    # the fewest nodes possible, so it counts as packed.
    topo = Topology(
        nodes=(NodeSlots(node_id="n0", gpu_indices=(0, 1, 3)), NodeSlots(node_id="n1", gpu_indices=(1, 2, 3)))
    )
    p = place_min_migration(topo, {"a": 4}, {}, allow_split=False)
    assert p.placements["a"] == gpus("n0", 0, 1, 3) + gpus("n1", 1)


def test_a_job_whose_gpu_was_drained_keeps_the_rest() -> None:
    topo = Topology(
        nodes=(
            NodeSlots(node_id="n0", gpu_indices=(0, 2, 3)),
            NodeSlots(node_id="n1", gpu_indices=(0, 1, 2, 3)),
        )
    )
    p = place_min_migration(topo, {"a": 2}, {"a": gpus("n0", 0, 1)})
    assert p.migrations == 0
    assert GpuRef("n0", 0) in p.placements["a"]
    assert GpuRef("n0", 1) not in p.placements["a"]


def test_gpu_types_restrict_jobs_to_their_nodes() -> None:
    topo = Topology(
        nodes=(
            NodeSlots(node_id="k0", gpu_indices=(0, 1, 2, 3), gpu_type="K80"),
            NodeSlots(node_id="v0", gpu_indices=(0, 1, 2, 3), gpu_type="V100"),
        )
    )
    shares = {"k": 2, "v": 4, "any": 2}
    types = {"k": "K80", "v": "V100"}
    p = place_min_migration(topo, shares, {}, types)
    check_placement(topo, shares, p, types)
    assert {g.node_id for g in p.placements["k"]} == {"k0"}
    assert {g.node_id for g in p.placements["v"]} == {"v0"}
    assert {g.node_id for g in p.placements["any"]} == {"k0"}
    # A type with no nodes cannot be placed.
    q = place_min_migration(topo, {"x": 1}, {}, {"x": "A100"})
    assert q.unplaced == {"x": 1}


def test_previous_gpus_on_a_node_of_the_wrong_type_count_as_a_move() -> None:
    topo = Topology(
        nodes=(
            NodeSlots(node_id="k0", gpu_indices=(0, 1), gpu_type="K80"),
            NodeSlots(node_id="v0", gpu_indices=(0, 1), gpu_type="V100"),
        )
    )
    p = place_min_migration(topo, {"a": 1}, {"a": gpus("k0", 0)}, {"a": "V100"})
    assert p.placements["a"] == gpus("v0", 0)
    assert p.migrations == 1


# --- properties -------------------------------------------------------------------------


@given(scenario(), st.booleans())
@settings(max_examples=400, deadline=None)
def test_placement_is_always_valid(case, allow_split: bool) -> None:  # type: ignore[no-untyped-def]
    topo, shares, previous, types = case
    p = place_min_migration(topo, shares, previous, types, allow_split=allow_split)
    check_placement(topo, shares, p, types)
    assert p.migrations == count_migrations(previous, p.placements)


@st.composite
def packed_history(draw: st.DrawFn) -> tuple[Topology, int, dict[str, int], dict[str, tuple[GpuRef, ...]]]:
    """A homogeneous cluster with a previous placement produced by the placer itself from
    regulated shares (a placement CoDDL would actually be in)."""
    g = draw(st.sampled_from([2, 4, 8]))
    m = draw(st.integers(1, 8))
    sizes = [*sub_node_sizes(g), *(g * k for k in range(1, m + 1))]
    left = g * m
    shares: dict[str, int] = {}
    for i in range(draw(st.integers(1, 16))):
        fitting = [s for s in sizes if s <= left]
        if not fitting:
            break
        shares[f"j{i:02d}"] = s = draw(st.sampled_from(fitting))
        left -= s
    topo = Topology.homogeneous(m, g)
    start = place_min_migration(topo, shares, {}, allow_split=False)
    return topo, g, shares, start.placements


@given(packed_history())
@settings(max_examples=300, deadline=None)
def test_same_shares_reproduce_the_previous_placement(case) -> None:  # type: ignore[no-untyped-def]
    topo, _, shares, previous = case
    p = place_min_migration(topo, shares, previous, allow_split=False)
    assert p.placements == previous
    assert p.migrations == 0


@given(packed_history(), st.data())
@settings(max_examples=300, deadline=None)
def test_shrinking_moves_nobody_and_keeps_only_old_gpus(case, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    topo, g, shares, previous = case
    smaller = {
        j: data.draw(st.sampled_from([v for v in range(0, s + 1) if is_regulated(v, g)]), label=j)
        for j, s in shares.items()
    }
    p = place_min_migration(topo, smaller, previous, allow_split=False)
    check_placement(topo, smaller, p)
    assert p.unplaced == {}
    assert p.migrations == 0
    for job, gpus_now in p.placements.items():
        assert set(gpus_now) <= set(previous[job])


@given(packed_history(), st.data())
@settings(max_examples=300, deadline=None)
def test_regulated_churn_always_packs_and_keeps_what_fits(case, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    # Arbitrary new regulated shares (some jobs leave, some grow, newcomers arrive) that fit:
    # with history, every job is still placed and network-packed (Proposition 1).
    topo, g, shares, previous = case
    m = len(topo.nodes)
    sizes = [*sub_node_sizes(g), *(g * k for k in range(1, m + 1))]
    left = g * m
    new: dict[str, int] = {}
    for job in [*shares, "x1", "x2", "x3"]:
        fitting = [0, *(s for s in sizes if s <= left)]
        new[job] = v = data.draw(st.sampled_from(fitting), label=job)
        left -= v
    p = place_min_migration(topo, new, previous, allow_split=False)
    check_placement(topo, new, p)
    assert p.unplaced == {}
    for job, v in new.items():
        if v:
            assert nodes_used(p.placements[job]) == -(-v // g)


@given(scenario(), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_the_order_of_the_mappings_does_not_matter(case, rnd) -> None:  # type: ignore[no-untyped-def]
    topo, shares, previous, types = case

    def shuffled(d: dict) -> dict:  # type: ignore[type-arg]
        items = list(d.items())
        rnd.shuffle(items)
        return dict(items)

    a = place_min_migration(topo, shares, previous, types)
    b = place_min_migration(topo, shuffled(shares), shuffled(previous), shuffled(types))
    assert a.placements == b.placements
    assert a.unplaced == b.unplaced
    assert a.migrations == b.migrations


@given(scenario(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_skipping_the_whole_node_costs_without_multi_node_shares_changes_nothing(
    case, allow_split: bool
) -> None:  # type: ignore[no-untyped-def]
    # The placer keeps displacement costs only when some share takes whole nodes; with
    # them kept regardless, every placement must be the same.
    from shoal.placement.min_migration import _MinMigration, _place_all

    topo, shares, previous, types = case
    fast = _place_all(_MinMigration(topo, shares, previous, types), allow_split)
    full = _place_all(_MinMigration(topo, shares, previous, types, always_track_costs=True), allow_split)
    assert fast == full


@given(packed_history(), st.data())
@settings(max_examples=200, deadline=None)
def test_sub_node_churn_places_the_same_with_and_without_costs(case, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    from shoal.placement.min_migration import _MinMigration, _place_all

    topo, g, shares, previous = case
    sizes = sub_node_sizes(g)
    new = {job: data.draw(st.sampled_from([0, *sizes]), label=job) for job in [*shares, "x1", "x2"]}
    fast = _place_all(_MinMigration(topo, new, previous, None), False)
    full = _place_all(_MinMigration(topo, new, previous, None, always_track_costs=True), False)
    assert fast == full


# --- the shortcut for kept and new jobs ------------------------------------------------


def _full_steps(topo, shares, previous, types, allow_split):  # type: ignore[no-untyped-def]
    from shoal.placement.min_migration import _MinMigration, _place_all

    return _place_all(_MinMigration(topo, shares, previous, types, always_track_costs=True), allow_split)


def test_the_shortcut_places_newcomers_in_the_least_slack_around_kept_jobs() -> None:
    from shoal.placement.min_migration import _place_kept_and_new

    topo = Topology.homogeneous(3, 4)
    before = {"a": gpus("n0", 0), "b": gpus("n0", 2, 3), "c": gpus("n1", 1), "gone": gpus("n2", 0)}
    shares = {"a": 1, "b": 2, "c": 1, "gone": 0, "x": 1, "y": 2, "z": 2}
    quick = _place_kept_and_new(topo, shares, before, None)
    assert quick is not None
    assert quick == _full_steps(topo, shares, before, None, True)
    assert quick.placements["a"] == before["a"] and quick.placements["b"] == before["b"]
    # y, z first (larger shares, then id): y to n1 (slack 3, the least that fits), on 0
    # and its nearest free neighbour 2; z to n2 (slack 4); x to n0's last free GPU.
    assert quick.placements["y"] == gpus("n1", 0, 2)
    assert quick.placements["z"] == gpus("n2", 0, 1)
    assert quick.placements["x"] == gpus("n0", 1)
    assert quick.migrations == 0 and quick.unplaced == {}


def test_the_shortcut_gives_way_when_a_newcomer_would_displace_a_kept_job() -> None:
    from shoal.placement.min_migration import _place_kept_and_new

    topo = Topology.homogeneous(2, 2)
    before = {"a": gpus("n0", 0), "b": gpus("n1", 0)}
    shares = {"a": 1, "b": 1, "x": 2}  # no node has 2 GPUs nobody keeps
    assert _place_kept_and_new(topo, shares, before, None) is None
    # ... and whatever does not fit its conditions: a whole node, a resize, a GPU held
    # twice, a job split over nodes.
    assert _place_kept_and_new(topo, {"a": 2}, before, None) is None  # 2 GPUs: a whole node here
    big = Topology.homogeneous(2, 4)
    assert _place_kept_and_new(big, {"a": 2, "b": 1}, {"a": gpus("n0", 0, 1)}, None) is not None
    assert _place_kept_and_new(big, {"a": 2}, {"a": gpus("n0", 0)}, None) is None  # a resize
    assert _place_kept_and_new(big, {"a": 2}, {"a": gpus("n0", 0, 0)}, None) is None  # a GPU twice
    assert _place_kept_and_new(topo, {"a": 2}, {"a": gpus("n0", 0) + gpus("n1", 0)}, None) is None
    assert _place_kept_and_new(big, {"a": 2}, {"a": gpus("n0", 0) + gpus("n1", 0)}, None) is None  # split
    assert _place_kept_and_new(big, {"a": 4}, {}, None) is None  # a whole node


@given(scenario(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_the_shortcut_equals_the_full_steps_on_arbitrary_input(case, allow_split: bool) -> None:  # type: ignore[no-untyped-def]
    from shoal.placement.min_migration import _place_kept_and_new

    topo, shares, previous, types = case
    quick = _place_kept_and_new(topo, shares, previous, types)
    if quick is not None:
        assert quick == _full_steps(topo, shares, previous, types, allow_split)


@given(packed_history(), st.data(), st.randoms(use_true_random=False))
@settings(max_examples=400, deadline=None)
def test_the_shortcut_equals_the_full_steps_under_sub_node_churn(case, data: st.DataObject, rnd) -> None:  # type: ignore[no-untyped-def]
    # What a congested cluster does at each decision: some jobs keep their share, some
    # leave, newcomers of sub-node sizes arrive (in any mapping order).
    from shoal.placement.min_migration import _place_kept_and_new

    topo, g, shares, previous = case
    sizes = sub_node_sizes(g)
    new = {j: (s if s < g and data.draw(st.booleans(), label=j) else 0) for j, s in shares.items()}
    for k in range(data.draw(st.integers(0, 6), label="newcomers")):
        new[f"x{k}"] = data.draw(st.sampled_from(sizes), label=f"x{k}")
    items = list(new.items())
    rnd.shuffle(items)
    new = dict(items)
    quick = _place_kept_and_new(topo, new, previous, None)
    full = _full_steps(topo, new, previous, None, False)
    if quick is not None:
        assert quick == full
    else:
        # It only gives way when some newcomer cannot go on GPUs nobody keeps.
        kept = sum(s for j, s in new.items() if j in previous)
        assert sum(new.values()) - kept > 0

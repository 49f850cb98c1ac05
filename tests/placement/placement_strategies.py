"""Hypothesis strategies shared by the placement tests."""

from __future__ import annotations

from hypothesis import strategies as st
from shoal.events import GpuRef
from shoal.placement import NodeSlots, Topology


@st.composite
def scenario(
    draw: st.DrawFn,
) -> tuple[Topology, dict[str, int], dict[str, tuple[GpuRef, ...]], dict[str, str]]:
    """A random, possibly heterogeneous and partly drained cluster with arbitrary shares
    and an arbitrary (even overlapping or stale) previous placement."""
    n_nodes = draw(st.integers(1, 6))
    nodes = []
    for o in range(n_nodes):
        size = draw(st.sampled_from([1, 2, 4, 8]))
        usable = draw(st.sets(st.integers(0, size - 1), max_size=size))
        nodes.append(
            NodeSlots(
                node_id=f"n{o}",
                gpu_indices=tuple(sorted(usable)),
                gpu_type=draw(st.sampled_from(["", "A", "B"])),
            )
        )
    topo = Topology(nodes=tuple(nodes))
    all_refs = [GpuRef(f"n{o}", i) for o in range(n_nodes) for i in range(8)] + [GpuRef("gone", 0)]
    n_jobs = draw(st.integers(0, 8))
    shares = {f"j{i}": draw(st.integers(0, 10)) for i in range(n_jobs)}
    previous = {
        j: tuple(draw(st.lists(st.sampled_from(all_refs), max_size=6))) for j in shares if draw(st.booleans())
    }
    types = {j: draw(st.sampled_from(["", "A", "B"])) for j in shares if draw(st.booleans())}
    return topo, shares, previous, types

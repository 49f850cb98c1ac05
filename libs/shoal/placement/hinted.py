"""Placement that honours the policy's own node choice (Gandiva_fair §3.2-3.3).

Gandiva_fair chooses each job's server(s) itself: new jobs go to the least
ticket-loaded node, balance and packing migrations move jobs between nodes, and its
split stride schedules gangs node by node. The policy names those nodes
``<generation>#<i>`` (the ``i``-th server of that generation) and publishes, in
``SharesDecided.policy_memory[NODE_HINTS]``, the nodes of every job it schedules.
:func:`shoal.allocation.place` (the one placement step of the simulator and the placer
service) then calls :func:`place_hinted`, so the node choice, the load balancing and
the migrations the policy reports are the ones carried out.

Rules:

* ``<generation>#<i>`` is the ``i``-th node of the topology whose ``gpu_type`` is
  the generation (exact, else case-insensitive), in the topology's order; the empty
  generation (a homogeneous cluster) counts every node.
* A job takes its GPUs on its hinted nodes. First every job (those holding GPUs on
  their hinted nodes first, then by job id) takes the GPUs it holds now
  (``previous``) that are free there, then the free GPUs of its slot (``slots``: on
  its first node, the usable GPUs from that position on); then each takes the lowest
  free GPUs of its hinted nodes, in hint order. So a job the policy left in place
  keeps its GPUs, and a gang resumed after a suspension goes back to its servers, and
  to the GPUs of its slot when they are free.
* A job whose hint names no such node, or whose hinted nodes lack free GPUs (drained
  GPUs the policy does not see), is placed by ``fallback`` (min-migration) on the
  GPUs left, or stays unplaced: a gang is placed whole or not at all.
* ``migrations`` counts, as every placer does, placed jobs that held GPUs and keep
  none (:func:`~shoal.placement.topology.count_migrations`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from shoal.events import GpuRef
from shoal.placement.topology import NodeSlots, Placement, Topology, count_migrations

NODE_HINTS = "node_hints"
"""Key of ``SharesDecided.policy_memory``: job id -> node names ``<generation>#<i>``."""
NODE_SLOTS = "gpu_slots"
"""Key of ``SharesDecided.policy_memory``: job id -> position, among its first hinted
node's usable GPUs (sorted), of the first GPU of its slot."""

Fallback = Callable[
    [Topology, Mapping[str, int], Mapping[str, tuple[GpuRef, ...]], Mapping[str, str] | None], Placement
]


def resolve_hint(topology: Topology, names: Sequence[str]) -> list[NodeSlots] | None:
    """The topology's nodes for hint names ``<generation>#<i>``; ``None`` if one is missing."""
    out: list[NodeSlots] = []
    for name in names:
        gen, sep, idx = str(name).rpartition("#")
        if not sep or not idx.isdigit():
            return None
        of_gen = [n for n in topology.nodes if not gen or n.gpu_type == gen]
        if gen and not of_gen:
            of_gen = [n for n in topology.nodes if n.gpu_type.lower() == gen.lower()]
        i = int(idx)
        if i >= len(of_gen):
            return None
        out.append(of_gen[i])
    return out


def _hint_index(topology: Topology) -> dict[str, NodeSlots]:
    """``#<i>`` (the ``i``-th node) and ``<gpu_type>#<i>`` (the ``i``-th node of that type)
    -> the node, as :func:`resolve_hint` resolves those names; other spellings (a
    case-insensitive type, a zero-padded index) are left to it.

    Built once per :func:`place_hinted` call, which is linear in the nodes where
    :func:`resolve_hint` is linear in the nodes for every name. Not kept across calls: a
    class-level cache is what ``shoal native build`` (mypyc) refuses without a
    ``ClassVar``."""
    index: dict[str, NodeSlots] = {}
    count: dict[str, int] = {}
    for i, node in enumerate(topology.nodes):
        index[f"#{i}"] = node
        if node.gpu_type:
            k = count.get(node.gpu_type, 0)
            count[node.gpu_type] = k + 1
            index[f"{node.gpu_type}#{k}"] = node
    return index


def place_hinted(
    topology: Topology,
    shares: Mapping[str, int],
    previous: Mapping[str, tuple[GpuRef, ...]],
    hints: Mapping[str, Sequence[str]],
    gpu_types: Mapping[str, str] | None = None,
    *,
    fallback: Fallback | None = None,
    slots: Mapping[str, int] | None = None,
) -> Placement:
    """Place ``shares`` on the nodes the policy chose (see the module docstring).

    Args:
        topology: Usable GPUs per node.
        shares: job id -> GPUs.
        previous: job id -> GPUs it holds now.
        hints: job id -> node names ``<generation>#<i>``; jobs without one go to ``fallback``.
        gpu_types: job id -> GPU type, for the fallback.
        fallback: Placer for the jobs the hints cannot place (default min-migration).
        slots: job id -> slot position on its first hinted node (see the module docstring).

    Returns:
        The placement.
    """
    if fallback is None:
        from shoal.placement.min_migration import place_min_migration

        fallback = place_min_migration
    # Each node's usable GPUs, sorted; a slot indexes those of its node (sorted again
    # there: the few jobs with a slot to take are fewer than the nodes).
    free: dict[str, list[int]] = {n.node_id: sorted(n.gpu_indices) for n in topology.nodes}
    wanted: dict[str, int] = {}
    # Each hinted job's nodes, and their distinct ids in hint order.
    targets: dict[str, list[NodeSlots]] = {}
    ids_of: dict[str, tuple[str, ...]] = {}
    rest: dict[str, int] = {}
    # A canonical name is looked up, any other goes through resolve_hint.
    index = _hint_index(topology)
    for job, share in shares.items():
        if share <= 0:
            continue
        wanted[job] = share
        names = hints.get(job)
        nodes: list[NodeSlots] | None = None
        if names:
            nodes = []
            for name in names:
                hinted = index.get(name) if type(name) is str else None
                if hinted is None:
                    found = resolve_hint(topology, (name,))
                    hinted = found[0] if found else None
                if hinted is None:
                    nodes = None
                    break
                nodes.append(hinted)
        if nodes is None:
            rest[job] = share
        else:
            targets[job] = nodes
            ids_of[job] = (
                (nodes[0].node_id,) if len(nodes) == 1 else tuple(dict.fromkeys([n.node_id for n in nodes]))
            )

    # Jobs that hold GPUs on their hinted nodes first, then the others, each by id.
    empty: tuple[GpuRef, ...] = ()
    holding: list[str] = []
    others: list[str] = []
    for j, ids in ids_of.items():
        for g in previous.get(j, empty):
            if g.node_id in ids:
                holding.append(j)
                break
        else:
            others.append(j)
    holding.sort()
    others.sort()
    order = holding + others
    placements: dict[str, tuple[GpuRef, ...]] = {}
    taken: dict[str, list[GpuRef]] = {}
    # The jobs that keep a GPU they hold (pass 1): not migrated if the hints place them.
    kept_any: set[str] = set()

    # Pass 1, every job: the GPUs it holds on its hinted nodes, then its slot's free GPUs.
    slot_of = slots or {}
    for job in order:
        got: list[GpuRef] = []
        taken[job] = got
        want = wanted[job]
        ids = ids_of[job]
        for g in previous.get(job, empty):
            if len(got) < want and g.node_id in ids:
                here = free[g.node_id]
                if g.index in here:
                    here.remove(g.index)
                    got.append(g)
        if got:
            kept_any.add(job)
        slot = slot_of.get(job)
        if isinstance(slot, int) and slot >= 0 and len(got) < want:
            first = targets[job][0]
            node_id = first.node_id
            here = free[node_id]
            for i in sorted(first.gpu_indices)[slot : slot + want]:
                if len(got) < want and i in here:
                    here.remove(i)
                    got.append(GpuRef(node_id=node_id, index=i))
    # Pass 2: the lowest free GPUs on the hinted nodes, in hint order; whole gang or nothing.
    for job in order:
        got = taken[job]
        want = wanted[job]
        for node in ids_of[job]:
            need = want - len(got)
            if need <= 0:
                break
            here = free[node]
            if here:
                got.extend([GpuRef(node_id=node, index=i) for i in here[:need]])
                del here[:need]
        if len(got) < want:
            for g in got:
                free[g.node_id].append(g.index)
                free[g.node_id].sort()
            rest[job] = want
            kept_any.discard(job)
        else:
            placements[job] = tuple(sorted(got)) if len(got) > 1 else tuple(got)
    unplaced: dict[str, int] = {}
    if rest:
        left = Topology(
            nodes=tuple(
                NodeSlots(node_id=n.node_id, gpu_indices=tuple(free[n.node_id]), gpu_type=n.gpu_type)
                for n in topology.nodes
                if free[n.node_id]
            )
        )
        sub = fallback(left, rest, {j: previous[j] for j in rest if j in previous}, gpu_types)
        placements.update({j: g for j, g in sub.placements.items() if g})
        unplaced = dict(sub.unplaced)
    # A job its hints placed that kept a GPU it held is no migration: count the others.
    migrations = count_migrations(
        previous, {j: g for j, g in placements.items() if j not in kept_any} if kept_any else placements
    )
    return Placement(placements=placements, migrations=migrations, unplaced=unplaced)

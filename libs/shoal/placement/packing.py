"""Network packing against a real topology: per GPU type, and with drained GPUs.

:func:`regulate_shares` proves its packing guarantee for ``m`` full nodes of ``G``
GPUs (AFS appendix E). A real cluster has GPU types and drained GPUs, so
:func:`regulate_for_topology` regulates each type against its own node size and
GPU count, then *checks* that the result packs by running the packed placer
(:func:`place_min_migration` with ``allow_split=False``, no history): any job left
unplaced steps down one regulated, feasible size and the check repeats. The loop
ends because the total strictly falls each round; on full, equal nodes it never
runs (Proposition 1).

Choices: jobs with a type are regulated first, type by type (sorted), against that
type's nodes; untyped jobs then share the largest node size of the whole cluster
and whatever GPUs the typed jobs left.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.placement.min_migration import place_min_migration
from shoal.placement.regulate import _Feasible, _next_down, regulate_shares, sub_node_sizes
from shoal.placement.topology import Topology


def regulate_for_topology(
    shares: Mapping[str, int],
    feasible: Mapping[str, tuple[int, ...]],
    topology: Topology,
    gpu_types: Mapping[str, str] | None = None,
    *,
    keep_unregulable: bool = False,
) -> dict[str, int]:
    """Regulate shares per GPU type so that they provably pack onto ``topology``.

    Args:
        shares: job id -> planned GPUs.
        feasible: job id -> allowed positive GPU counts (absent: any).
        topology: Usable GPUs per node.
        gpu_types: job id -> GPU type it must run on (absent or ``""``: any node).
        keep_unregulable: As in :func:`regulate_shares`; such a job must still pack
            (it steps down like any other when it does not).

    Returns:
        job id -> regulated share; placing these with ``place_min_migration(...,
        allow_split=False)`` and no history leaves nothing unplaced.

    Raises:
        ValueError: On a negative share.
    """
    types = gpu_types or {}
    groups: dict[str, dict[str, int]] = {}
    for job, s in shares.items():
        groups.setdefault(types.get(job, "") or "", {})[job] = s
    result: dict[str, int] = {}
    used = 0
    for t in sorted(k for k in groups if k):
        total_t = sum(n.capacity for n in topology.nodes if n.gpu_type == t)
        r = regulate_shares(
            groups[t], feasible, topology.gpus_per_node_of_type(t), total_t, keep_unregulable=keep_unregulable
        )
        result.update(r)
        used += sum(r.values())
    if "" in groups:
        left = max(0, topology.total_gpus - used)
        result.update(
            regulate_shares(
                groups[""], feasible, topology.gpus_per_node, left, keep_unregulable=keep_unregulable
            )
        )

    limits = {job: _Feasible(feasible.get(job), max(result[job], 1)) for job in result}
    while True:
        positive = {j: s for j, s in result.items() if s}
        placed = place_min_migration(topology, positive, {}, types, allow_split=False)
        if not placed.unplaced:
            return result
        for job in placed.unplaced:
            g = topology.gpus_per_node_of_type(types.get(job, "") or "")
            result[job] = _next_down(result[job], limits[job], g, sub_node_sizes(g))

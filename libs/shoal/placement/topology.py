"""Plain data for placement: the usable GPUs per node, and a placement decision.

A :class:`Topology` lists, per node, only the GPU indices a job may be given now
(healthy and not drained); whoever builds it from the cluster state filters out the
rest. Nodes keep the order they are listed in, and the placers break ties by that
order (never by node-id string order), so a caller controls tie-breaks by ordering
``Topology.nodes``.

:func:`check_placement` states every invariant a placer must keep; the property
tests and the simulator both call it.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from shoal.events import GpuRef


class PlacementError(ValueError):
    """A placement (or its input) that breaks an invariant."""


class NodeSlots(msgspec.Struct, frozen=True, kw_only=True):
    """The GPUs of one node that placement may hand out."""

    node_id: str
    gpu_indices: tuple[int, ...]
    """Usable (healthy, not drained) GPU indices on this node."""
    gpu_type: str = ""

    def __post_init__(self) -> None:
        if len(set(self.gpu_indices)) != len(self.gpu_indices):
            raise PlacementError(f"node {self.node_id!r} lists a GPU index twice: {self.gpu_indices}")
        if any(i < 0 for i in self.gpu_indices):
            raise PlacementError(f"node {self.node_id!r} has a negative GPU index: {self.gpu_indices}")

    @property
    def capacity(self) -> int:
        """How many usable GPUs the node has."""
        return len(self.gpu_indices)


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    """The placeable GPUs of a cluster, node by node."""

    nodes: tuple[NodeSlots, ...]

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise PlacementError("topology lists a node twice")

    @property
    def total_gpus(self) -> int:
        """Usable GPUs over all nodes."""
        return sum(len(n.gpu_indices) for n in self.nodes)

    @property
    def gpus_per_node(self) -> int:
        """Usable GPUs on the largest node (0 for an empty topology)."""
        return max((len(n.gpu_indices) for n in self.nodes), default=0)

    def gpus_per_node_of_type(self, gpu_type: str) -> int:
        """Usable GPUs on the largest node of ``gpu_type`` (``""``: of any type)."""
        return max(
            (len(n.gpu_indices) for n in self.nodes if not gpu_type or n.gpu_type == gpu_type),
            default=0,
        )

    @classmethod
    def homogeneous(cls, n_nodes: int, gpus_per_node: int, gpu_type: str = "", prefix: str = "n") -> Topology:
        """``n_nodes`` identical nodes ``{prefix}0 … {prefix}{n_nodes-1}``, GPUs ``0 … gpus_per_node-1``.

        Args:
            n_nodes: Number of nodes.
            gpus_per_node: GPUs on each node.
            gpu_type: GPU generation of every node.
            prefix: Node-id prefix.

        Returns:
            The topology.
        """
        indices = tuple(range(gpus_per_node))
        return cls(
            nodes=tuple(
                NodeSlots(node_id=f"{prefix}{i}", gpu_indices=indices, gpu_type=gpu_type)
                for i in range(n_nodes)
            )
        )


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Concrete GPUs for every placed job."""

    placements: dict[str, tuple[GpuRef, ...]]
    """job id -> concrete GPUs (sorted). Jobs with a zero share are absent."""
    migrations: int
    """Placed jobs that had GPUs before and kept none of them (they moved)."""
    unplaced: dict[str, int] = {}
    """Jobs with a positive share that got no GPUs at all -> GPUs missing (their whole share:
    a job gets exactly its share or nothing)."""


def kept_gpus(
    previous: Mapping[str, tuple[GpuRef, ...]], placements: Mapping[str, tuple[GpuRef, ...]]
) -> int:
    """How many (job, GPU) pairs survive from ``previous`` into ``placements``.

    Args:
        previous: job id -> GPUs it had.
        placements: job id -> GPUs it gets.

    Returns:
        The total number of GPUs jobs keep.
    """
    return sum(len(set(previous.get(j, ())) & set(gpus)) for j, gpus in placements.items())


def count_migrations(
    previous: Mapping[str, tuple[GpuRef, ...]], placements: Mapping[str, tuple[GpuRef, ...]]
) -> int:
    """Placed jobs that had GPUs before and keep none of them (CoDDL §4.4's "migration").

    Args:
        previous: job id -> GPUs it had.
        placements: job id -> GPUs it gets.

    Returns:
        The number of migrated jobs.
    """
    return sum(
        1 for j, gpus in placements.items() if gpus and previous.get(j) and not set(previous[j]) & set(gpus)
    )


def nodes_used(gpus: tuple[GpuRef, ...]) -> int:
    """How many distinct nodes a job's GPUs span."""
    return len({g.node_id for g in gpus})


def check_placement(
    topology: Topology,
    shares: Mapping[str, int],
    placement: Placement,
    gpu_types: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`PlacementError` unless ``placement`` is a valid answer for ``shares``.

    Checked: no GPU given twice; every GPU exists and is usable in ``topology``; every
    placed job gets exactly its share, on nodes of its type when ``gpu_types`` names one;
    placed GPUs are sorted; every job with a positive share is either placed or listed in
    ``unplaced`` with its whole share; nothing else is placed.

    Args:
        topology: The usable GPUs.
        shares: job id -> GPUs it should get.
        placement: The decision to check.
        gpu_types: job id -> required GPU type.
    """
    usable = {(n.node_id, i): n.gpu_type for n in topology.nodes for i in n.gpu_indices}
    seen: set[GpuRef] = set()
    types = gpu_types or {}
    for job, gpus in placement.placements.items():
        share = shares.get(job, 0)
        if len(gpus) != share:
            raise PlacementError(f"{job!r} got {len(gpus)} GPUs, share {share}")
        if list(gpus) != sorted(gpus):
            raise PlacementError(f"{job!r}'s GPUs are not sorted")
        for g in gpus:
            key = (g.node_id, g.index)
            if key not in usable:
                raise PlacementError(f"{job!r} given {g}, not a usable GPU")
            if g in seen:
                raise PlacementError(f"{g} given twice")
            seen.add(g)
            want = types.get(job, "")
            if want and usable[key] != want:
                raise PlacementError(f"{job!r} needs {want}, given {g} of type {usable[key]!r}")
        if job in placement.unplaced:
            raise PlacementError(f"{job!r} is both placed and unplaced")
    for job, share in shares.items():
        if share > 0 and job not in placement.placements and placement.unplaced.get(job) != share:
            raise PlacementError(f"{job!r} (share {share}) neither placed nor reported unplaced")

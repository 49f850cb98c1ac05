"""Pure helpers that read the cluster's shape out of the folded state."""

from __future__ import annotations

from shoal.placement import NodeSlots, Topology
from shoal.state import NODE_UP, ClusterState


def topology_from_state(state: ClusterState) -> Topology:
    """Usable GPUs per node: nodes that are up, healthy GPUs only, in registration order."""
    nodes = []
    for node_id, node in state.nodes.items():
        if node.status != NODE_UP:
            continue
        indices = tuple(i for i, g in enumerate(node.gpus) if g.healthy)
        gpu_type = node.gpus[0].gpu_type if node.gpus else ""
        nodes.append(NodeSlots(node_id=node_id, gpu_indices=indices, gpu_type=gpu_type))
    return Topology(nodes=tuple(nodes))


def gpus_per_node(state: ClusterState) -> int:
    """Size of the largest node that is up (0 when there is none)."""
    return max((len(n.gpus) for n in state.nodes.values() if n.status == NODE_UP), default=0)


def stale_nodes(state: ClusterState, now: float, timeout_s: float) -> list[str]:
    """Nodes that are up but whose last heartbeat is older than ``timeout_s``."""
    return [
        node_id
        for node_id, node in state.nodes.items()
        if node.status == NODE_UP and now - node.last_heartbeat_at > timeout_s
    ]

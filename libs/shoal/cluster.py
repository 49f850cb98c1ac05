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


HEARTBEAT_FLOOR = 0.25
"""Fraction of the heartbeat period below which a node's next heartbeat is flood: a
reader that rate-limits heartbeats (:func:`heartbeat_counts`) takes at most one per
``HEARTBEAT_FLOOR × heartbeat_s`` of occurred-at time per node."""


def lost_nodes(state: ClusterState, *, caught_up_at: float | None, timeout_s: float) -> list[str]:
    """Nodes that are up but whose heartbeats stopped, judged from the log alone.

    The reference instant is the log's tail as far as the reader has provably read it:
    ``min(state.clock, caught_up_at)``, where ``state.clock`` is the newest occurred-at
    folded into ``state`` and ``caught_up_at`` an instant (the reader's clock) by
    which every event then in the log has been folded. A node is lost when its newest
    heartbeat (or registration) stamp is more than ``timeout_s`` older than that.

    So a reader that lags never declares a node lost because it has not read its
    heartbeats yet (it is not caught up: ``caught_up_at`` is ``None`` or older than
    what it has not read), and a stamp from the future (a forged or skewed clock)
    cannot make every other node look silent, since the reference is never later than
    the instant the reader caught up at. A log in which nothing at all happens has no
    tail that moves: nobody is declared lost (every node's heartbeats stopped at once,
    and there is no live node to move work to).

    Args:
        state: the folded log.
        caught_up_at: see above; ``None`` when the reader has not caught up with the
            log (then no node is lost).
        timeout_s: occurred-at seconds without a heartbeat after which a node is lost.

    Returns:
        The ids of the lost nodes, in registration order.
    """
    if caught_up_at is None:
        return []
    tail = min(state.clock, caught_up_at)
    return [
        node_id
        for node_id, node in state.nodes.items()
        if node.status == NODE_UP and tail - node.last_heartbeat_at > timeout_s
    ]


def heartbeat_counts(last_taken_at: float | None, at: float, floor_s: float) -> bool:
    """Whether a reader rate-limiting heartbeats takes a node's heartbeat stamped ``at``
    when the last it took from that node was stamped ``last_taken_at`` (``None``: none
    yet): only one at least ``floor_s`` newer. Heartbeats faster than that are a flood
    (a node daemon sends one per ``heartbeat_s``) and are skipped, so whatever a reader
    does per heartbeat it does at most once per ``floor_s`` per node."""
    return last_taken_at is None or at >= last_taken_at + floor_s

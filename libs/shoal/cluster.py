"""Pure helpers that read the cluster's shape out of the folded state."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

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


def remember_beats(
    remembered: dict[str, float], read: Mapping[str, float], up: Iterable[str], *, read_at: float
) -> dict[str, float]:
    """Fold one read of the beats stream into a reader's memory of each node's newest
    heartbeat stamp, in place, and return the memory of the nodes in ``up``.

    The beats stream keeps a heartbeat only for its TTL (:func:`shoal.bus.beat_ttl_s`),
    so a read may find none for a live node (one sent late) as well as for a dead one.
    Neither case can be told from the other at one read, so:

    * a stamp read moves the node's memory up, never back (a heartbeat stamped earlier,
      sent late or by a flood, does not undo a newer one);
    * a node with nothing stored and nothing remembered (the reader's first look: a
      new leader, or a node just registered) is remembered at ``read_at``. It gets a full
      timeout from that look before :func:`lost_nodes` can declare it, where judging it
      by its registration stamp would declare a live node lost whenever a new leader
      first read between two of its heartbeats.

    A node that died while no reader ran is therefore declared one timeout after the
    new reader's first look, not at it.
    """
    nodes = list(up)
    for node_id in nodes:
        at = read.get(node_id)
        if at is not None:
            if at > remembered.get(node_id, -math.inf):
                remembered[node_id] = at
        elif node_id not in remembered:
            remembered[node_id] = read_at
    return {n: remembered[n] for n in nodes}


def lost_nodes(
    state: ClusterState, beats: Mapping[str, float], *, read_at: float | None, timeout_s: float
) -> list[str]:
    """Nodes that are up but whose heartbeats stopped, judged by the heartbeats' own stamps.

    Heartbeats are not in the log (issue 21, bounded log growth): ``beats`` holds the
    occurred-at stamp of each node's newest heartbeat, as the beats stream had it when
    the reader read it (:meth:`shoal.bus.Bus.latest_beats`), and ``read_at`` is the
    reader's clock read just before that read. A node's newest sign of life is the newer
    of its heartbeat and its registration in the log (``last_heartbeat_at`` of the fold).

    The reference instant is the newest heartbeat of any node, but never later than
    ``read_at``: a node is lost when its newest sign of life is more than ``timeout_s``
    older than that. So what counts is how far the nodes' own stamps have drifted apart,
    not when the reader got round to reading them (a reader that was stopped or lags
    reads every node's current heartbeat at once and declares nobody for that), and a
    stamp from the future (a forged or skewed clock) cannot make every other node look
    silent. When every node's heartbeats stop at once, nothing moves the reference:
    nobody is declared lost (there is no live node to move work to).

    Args:
        state: the folded log (which nodes are up, and when each registered).
        beats: node id -> stamp of its newest heartbeat; nodes without one are judged by
            their registration.
        read_at: see above; ``None`` when the beats were not read (then no node is lost).
        timeout_s: occurred-at seconds without a heartbeat after which a node is lost.

    Returns:
        The ids of the lost nodes, in registration order.
    """
    if read_at is None or not beats:
        return []
    tail = min(max(beats.values()), read_at)
    return [
        node_id
        for node_id, node in state.nodes.items()
        if node.status == NODE_UP
        and tail - max(node.last_heartbeat_at, beats.get(node_id, -math.inf)) > timeout_s
    ]

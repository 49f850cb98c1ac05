"""The node-liveness rule (:func:`shoal.cluster.lost_nodes`), the heartbeat rate limit
and the fold's handling of heartbeats and of a lost node registering again."""

from __future__ import annotations

from shoal import events as ev
from shoal import state as st
from shoal.cluster import heartbeat_counts, lost_nodes, topology_from_state

GPUS = tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(2))


def cluster(beats: dict[str, float], *, clock: float) -> st.ClusterState:
    """Nodes registered at 0 whose newest heartbeats are ``beats``, then an event at ``clock``."""
    state = st.ClusterState()
    for node_id in beats:
        st.apply_event(state, ev.NodeRegistered(node_id=node_id, gpus=GPUS), 0.0)
    for node_id, at in beats.items():
        st.apply_event(state, ev.NodeHeartbeat(node_id=node_id), at)
    st.apply_event(state, ev.TicketsSet(user="u", tickets=1), clock)
    return state


def test_a_node_is_lost_once_the_log_moved_on_past_the_timeout() -> None:
    state = cluster({"a": 100.0, "b": 89.0}, clock=100.0)
    assert lost_nodes(state, caught_up_at=100.0, timeout_s=10.0) == ["b"]
    assert lost_nodes(state, caught_up_at=100.0, timeout_s=11.0) == []


def test_a_reader_that_has_not_caught_up_declares_nobody() -> None:
    state = cluster({"a": 100.0, "b": 50.0}, clock=100.0)
    assert lost_nodes(state, caught_up_at=None, timeout_s=10.0) == []


def test_the_reference_is_the_folded_tail_not_the_readers_clock() -> None:
    # A reader that folded the log up to 100 but whose clock says 1000 (it was stopped,
    # or lags) judges against 100: the heartbeats it has not read cannot count against.
    state = cluster({"a": 95.0, "b": 92.0}, clock=100.0)
    assert lost_nodes(state, caught_up_at=1000.0, timeout_s=10.0) == []


def test_a_stamp_from_the_future_does_not_make_the_others_silent() -> None:
    state = cluster({"a": 95.0, "b": 92.0}, clock=100.0)
    st.apply_event(state, ev.NodeHeartbeat(node_id="a"), 10_000.0)  # forged or skewed
    assert state.clock == 10_000.0
    assert lost_nodes(state, caught_up_at=100.0, timeout_s=10.0) == []
    assert lost_nodes(state, caught_up_at=103.0, timeout_s=10.0) == ["b"]


def test_only_nodes_that_are_up_can_be_lost() -> None:
    state = cluster({"a": 0.0, "b": 0.0, "c": 0.0}, clock=100.0)
    st.apply_event(state, ev.NodeLost(node_id="a"), 100.0)
    st.apply_event(state, ev.NodeDrained(node_id="b"), 100.0)
    assert lost_nodes(state, caught_up_at=100.0, timeout_s=10.0) == ["c"]


def test_a_heartbeat_arriving_late_does_not_move_the_newest_stamp_back() -> None:
    state = cluster({"a": 100.0}, clock=100.0)
    st.apply_event(state, ev.NodeHeartbeat(node_id="a"), 40.0)
    assert state.nodes["a"].last_heartbeat_at == 100.0


def test_a_lost_node_that_registers_again_is_up_with_its_gpus() -> None:
    state = cluster({"a": 10.0, "b": 100.0}, clock=100.0)
    st.apply_event(state, ev.NodeLost(node_id="a"), 100.0)
    assert [n.node_id for n in topology_from_state(state).nodes] == ["b"]
    st.apply_event(state, ev.NodeRegistered(node_id="a", gpus=GPUS), 105.0)
    assert state.nodes["a"].status == st.NODE_UP
    assert state.nodes["a"].last_heartbeat_at == 105.0
    assert {n.node_id: n.gpu_indices for n in topology_from_state(state).nodes} == {"a": (0, 1), "b": (0, 1)}
    assert lost_nodes(state, caught_up_at=110.0, timeout_s=10.0) == []


def test_heartbeats_faster_than_the_floor_are_skipped() -> None:
    assert heartbeat_counts(None, 5.0, 0.25)
    assert not heartbeat_counts(5.0, 5.1, 0.25)
    assert heartbeat_counts(5.0, 5.25, 0.25)
    # A flood of 10,000 heartbeats in one second: one per 0.25 s is taken.
    taken: float | None = None
    count = 0
    for i in range(10_000):
        at = 5.0 + i / 10_000
        if heartbeat_counts(taken, at, 0.25):
            taken, count = at, count + 1
    assert count == 4

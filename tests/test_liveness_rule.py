"""The node-liveness rule (:func:`shoal.cluster.lost_nodes`) over the newest heartbeats
read from the beats stream (remembered across reads by :func:`shoal.cluster.remember_beats`), and the fold's handling of a lost node registering again
(and of heartbeats in a log written before the beats stream)."""

from __future__ import annotations

from shoal import events as ev
from shoal import state as st
from shoal.cluster import lost_nodes, remember_beats, topology_from_state

GPUS = tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(2))


def cluster(*node_ids: str, registered_at: float = 0.0) -> st.ClusterState:
    """Nodes registered at ``registered_at`` (heartbeats are not in the log)."""
    state = st.ClusterState()
    for node_id in node_ids:
        st.apply_event(state, ev.NodeRegistered(node_id=node_id, gpus=GPUS), registered_at)
    return state


def test_a_node_is_lost_once_the_others_heartbeats_moved_on_past_the_timeout() -> None:
    state = cluster("a", "b")
    beats = {"a": 100.0, "b": 89.0}
    assert lost_nodes(state, beats, read_at=100.0, timeout_s=10.0) == ["b"]
    assert lost_nodes(state, beats, read_at=100.0, timeout_s=11.0) == []


def test_beats_that_were_not_read_declare_nobody() -> None:
    state = cluster("a", "b")
    assert lost_nodes(state, {"a": 100.0, "b": 50.0}, read_at=None, timeout_s=10.0) == []
    assert lost_nodes(state, {}, read_at=100.0, timeout_s=10.0) == []


def test_the_reference_is_the_heartbeats_not_the_readers_clock() -> None:
    # A reader whose clock says 1000 (it was stopped, or lags) when it reads beats
    # stamped 95 and 92 judges against 95: how late it reads them does not count.
    state = cluster("a", "b")
    assert lost_nodes(state, {"a": 95.0, "b": 92.0}, read_at=1000.0, timeout_s=10.0) == []


def test_every_node_silent_at_once_declares_nobody() -> None:
    state = cluster("a", "b")
    assert lost_nodes(state, {"a": 10.0, "b": 10.0}, read_at=1000.0, timeout_s=10.0) == []


def test_a_stamp_from_the_future_does_not_make_the_others_silent() -> None:
    state = cluster("a", "b")
    beats = {"a": 10_000.0, "b": 92.0}  # a's forged or skewed
    assert lost_nodes(state, beats, read_at=100.0, timeout_s=10.0) == []
    assert lost_nodes(state, beats, read_at=103.0, timeout_s=10.0) == ["b"]


def test_a_node_without_a_heartbeat_is_judged_by_its_registration() -> None:
    state = cluster("a")
    st.apply_event(state, ev.NodeRegistered(node_id="b", gpus=GPUS), 95.0)
    assert lost_nodes(state, {"a": 100.0}, read_at=100.0, timeout_s=10.0) == []
    assert lost_nodes(state, {"a": 106.0}, read_at=106.0, timeout_s=10.0) == ["b"]


def test_a_registration_newer_than_the_last_heartbeat_counts() -> None:
    state = cluster("a", "b")
    st.apply_event(state, ev.NodeRegistered(node_id="b", gpus=GPUS), 99.0)  # came back
    assert lost_nodes(state, {"a": 100.0, "b": 20.0}, read_at=100.0, timeout_s=10.0) == []


def test_only_nodes_that_are_up_can_be_lost() -> None:
    state = cluster("a", "b", "c", "d")
    st.apply_event(state, ev.NodeLost(node_id="a"), 100.0)
    st.apply_event(state, ev.NodeDrained(node_id="b"), 100.0)
    beats = {"a": 0.0, "b": 0.0, "c": 0.0, "d": 100.0}
    assert lost_nodes(state, beats, read_at=100.0, timeout_s=10.0) == ["c"]


def test_a_heartbeat_in_an_old_log_still_folds_and_a_late_one_does_not_move_it_back() -> None:
    state = cluster("a", "b")
    st.apply_event(state, ev.NodeHeartbeat(node_id="a"), 100.0)
    st.apply_event(state, ev.NodeHeartbeat(node_id="a"), 40.0)
    assert state.nodes["a"].last_heartbeat_at == 100.0
    # The log's heartbeat is a sign of life like a registration.
    assert lost_nodes(state, {"b": 108.0}, read_at=108.0, timeout_s=10.0) == []
    assert lost_nodes(state, {"b": 112.0}, read_at=112.0, timeout_s=10.0) == ["a"]


def test_a_lost_node_that_registers_again_is_up_with_its_gpus() -> None:
    state = cluster("a", "b")
    st.apply_event(state, ev.NodeLost(node_id="a"), 100.0)
    assert [n.node_id for n in topology_from_state(state).nodes] == ["b"]
    st.apply_event(state, ev.NodeRegistered(node_id="a", gpus=GPUS), 105.0)
    assert state.nodes["a"].status == st.NODE_UP
    assert state.nodes["a"].last_heartbeat_at == 105.0
    assert {n.node_id: n.gpu_indices for n in topology_from_state(state).nodes} == {"a": (0, 1), "b": (0, 1)}
    assert lost_nodes(state, {"a": 10.0, "b": 110.0}, read_at=110.0, timeout_s=10.0) == []


def test_a_reader_remembers_the_newest_stamp_and_a_late_one_does_not_move_it_back() -> None:
    memory: dict[str, float] = {}
    assert remember_beats(memory, {"a": 100.0, "b": 99.0}, ["a", "b"], read_at=100.0) == {
        "a": 100.0,
        "b": 99.0,
    }
    # b's heartbeat expired from the stream (sent late): the memory keeps 99, not the read instant.
    assert remember_beats(memory, {"a": 101.0}, ["a", "b"], read_at=101.5) == {"a": 101.0, "b": 99.0}
    assert remember_beats(memory, {"a": 90.0, "b": 102.0}, ["a", "b"], read_at=102.0) == {
        "a": 101.0,
        "b": 102.0,
    }
    # Only the nodes asked about come back; the others stay remembered.
    assert remember_beats(memory, {}, ["b"], read_at=103.0) == {"b": 102.0}
    assert memory == {"a": 101.0, "b": 102.0}


def test_a_new_reader_that_finds_no_heartbeat_gives_the_node_a_timeout_from_its_first_look() -> None:
    # A new leader reads at 500, between two of b's heartbeats (b's last one expired): judged
    # by its registration at 0, b would be declared at once although it is alive.
    state = cluster("a", "b")
    memory: dict[str, float] = {}
    beats = remember_beats(memory, {"a": 500.0}, ["a", "b"], read_at=500.0)
    assert beats == {"a": 500.0, "b": 500.0}
    assert lost_nodes(state, beats, read_at=500.0, timeout_s=10.0) == []
    # b beats again: alive.
    beats = remember_beats(memory, {"a": 505.0, "b": 504.0}, ["a", "b"], read_at=505.0)
    assert lost_nodes(state, beats, read_at=505.0, timeout_s=10.0) == []
    # c died while no reader ran: declared one timeout after the first look, not before.
    state = cluster("a", "c")
    memory = {}
    beats = remember_beats(memory, {"a": 500.0}, ["a", "c"], read_at=500.0)
    assert lost_nodes(state, beats, read_at=500.0, timeout_s=10.0) == []
    beats = remember_beats(memory, {"a": 509.0}, ["a", "c"], read_at=509.0)
    assert lost_nodes(state, beats, read_at=509.0, timeout_s=10.0) == []
    beats = remember_beats(memory, {"a": 511.0}, ["a", "c"], read_at=511.0)
    assert lost_nodes(state, beats, read_at=511.0, timeout_s=10.0) == ["c"]


def test_a_first_look_with_every_heartbeat_expired_declares_nobody_later() -> None:
    # Every node silent when a new reader starts: each is remembered at the first look and
    # nothing moves the reference after it, so nobody is declared.
    state = cluster("a", "b")
    memory: dict[str, float] = {}
    for read_at in (500.0, 520.0, 600.0):
        beats = remember_beats(memory, {}, ["a", "b"], read_at=read_at)
        assert lost_nodes(state, beats, read_at=read_at, timeout_s=10.0) == []

"""The state fold: determinism, snapshots, and replay-equals-live over a real server."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, fold_log

from tests.strategies import histories


@given(histories())
def test_fold_is_deterministic_and_survives_the_codec(history: list[ev.Envelope]) -> None:
    direct = st.fold(history)
    through_wire = st.fold(codec.decode(codec.encode(e)) for e in history)
    assert st.digest(direct) == st.digest(through_wire) == st.digest(st.fold(history))


@given(histories(), hs.data())
def test_snapshot_plus_tail_equals_full_fold(history: list[ev.Envelope], data: hs.DataObject) -> None:
    cut = data.draw(hs.integers(0, len(history)))
    snapshot = st.encode_state(st.fold(history[:cut]))
    resumed = st.fold(history[cut:], st.decode_state(snapshot))
    assert st.digest(resumed) == st.digest(st.fold(history))


@given(histories(min_size=1))
def test_copy_state_is_independent(history: list[ev.Envelope]) -> None:
    state = st.fold(history[:-1])
    frozen = st.copy_state(state)
    before = st.digest(frozen)
    st.apply(state, history[-1])
    assert st.digest(frozen) == before


def test_attained_service_and_shares() -> None:
    spec = ev.JobSpec(user="alice", max_gpus=4, total_iterations=100)
    history = [
        codec.wrap(ev.JobSubmitted(job_id="a", spec=spec), at=0.0),
        codec.wrap(ev.JobSubmitted(job_id="b", spec=spec), at=0.0),
        codec.wrap(ev.SharesDecided(epoch=1, shares={"a": 4}), at=10.0),
        codec.wrap(ev.SharesDecided(epoch=2, shares={"a": 2, "b": 2}), at=20.0),
        codec.wrap(ev.SharesDecided(epoch=1, shares={"a": 4}), at=25.0),  # stale epoch: ignored
        codec.wrap(ev.JobCompleted(job_id="a", iterations=100), at=30.0),
    ]
    state = st.fold(history)
    assert state.shares_epoch == 2
    assert state.jobs["a"].attained_service_gpu_s == pytest.approx(4 * 10 + 2 * 10)
    assert state.jobs["a"].status == st.COMPLETED and state.jobs["a"].gpus == 0
    assert state.service_at("b", 40.0) == pytest.approx(2 * 20)


def test_digest_and_snapshot_of_jobs_with_known_profiles() -> None:
    """A profile is keyed by GPU count (ints), which msgpack cannot key-sort: the
    digest must still work (the allocator's snapshot computes it), stay independent of
    insertion order and see a changed profile."""

    def state_with(profile: dict[str, dict[int, float]]) -> st.ClusterState:
        spec = ev.JobSpec(user="alice", max_gpus=4, total_iterations=100, profile=profile)
        return st.fold([codec.wrap(ev.JobSubmitted(job_id="a", spec=spec), at=0.0)])

    one = state_with({"": {1: 1.0, 2: 1.9}, "V100": {1: 2.0}})
    reordered = state_with({"V100": {1: 2.0}, "": {2: 1.9, 1: 1.0}})
    assert st.digest(one) == st.digest(reordered) == st.digest(st.copy_state(one))
    assert st.digest(one) != st.digest(state_with({"": {1: 1.0, 2: 1.8}, "V100": {1: 2.0}}))


def test_unknown_event_objects_are_ignored() -> None:
    class Future(ev.Event, tag="job.future"):
        job_id: str

    state = st.ClusterState()
    st.apply_event(state, Future(job_id="x"), at=5.0)
    assert state.jobs == {}


@pytest.mark.integration
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories(min_size=1, max_size=150))
async def test_replay_equals_live(nats_url: str, history: list[ev.Envelope]) -> None:
    """A consumer that folds the live tail ends with the digest a fresh replay computes."""
    prefix = f"live{next(_counter)}"
    bus = await Bus.connect(nats_url, prefix=prefix, creds=os.environ["NATS_CREDS"])
    try:
        live = st.ClusterState()
        stop = asyncio.Event()
        folded = 0

        async def follower() -> None:
            nonlocal folded
            async for batch in bus.replay_batches(follow=True, batch=32, stop=stop, idle_expires_s=0.2):
                for _, env in batch:
                    st.apply(live, env)
                folded = batch.last_seq
                if folded >= len(history):
                    stop.set()

        task = asyncio.create_task(follower())
        for start in range(0, len(history), 17):
            await bus.publish_many(history[start : start + 17])
        await asyncio.wait_for(task, 20)
        replayed, last = await fold_log(bus, st.ClusterState(), st.apply)
        assert last == len(history)
        assert st.digest(replayed) == st.digest(live) == st.digest(st.fold(history))
    finally:
        await bus.close()


_counter = iter(range(1, 10**9))

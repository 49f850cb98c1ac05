"""The bus against a real nats-server: publish, dedupe, concurrency, replay, leases, snapshots."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, ConcurrencyConflict, NoServerError, fold_log
from shoal.events import Envelope

pytestmark = pytest.mark.integration


def submitted(i: int, user: str = "alice") -> ev.JobSubmitted:
    return ev.JobSubmitted(job_id=f"j{i}", spec=ev.JobSpec(user=user, total_iterations=100))


async def test_connect_to_nothing_is_a_clear_error() -> None:
    with pytest.raises(NoServerError, match=r"no NATS server reachable at nats://127.0.0.1:1"):
        await Bus.connect("nats://127.0.0.1:1", connect_timeout_s=0.2, initial_connect_timeout_s=1.0)


async def test_declare_is_idempotent(bus: Bus) -> None:
    await bus.declare()
    await bus.declare()
    info = await bus.js.stream_info(bus.names.events_stream)
    assert sorted(info.config.subjects or []) == sorted(bus.names.event_subjects)
    # Dead letters, which every role but a client may write, are bounded in age and size.
    dlq = (await bus.js.stream_info(bus.names.dlq_stream)).config
    assert (dlq.max_age, dlq.max_msgs) == (30 * 24 * 3600.0, 10_000)
    # The sidecars' rendezvous bucket exists before any sidecar (which may not create it).
    await bus.js.key_value(bus.names.train_meta_bucket)


async def test_publish_then_replay_in_order(bus: Bus) -> None:
    envs = [codec.wrap(submitted(i)) for i in range(500)]
    results = await bus.publish_many(envs, window=64)
    assert [r.seq for r in results] == list(range(1, 501))
    got = [(seq, env) async for seq, env in bus.replay()]
    assert [seq for seq, _ in got] == list(range(1, 501))
    assert [env for _, env in got] == envs


async def test_duplicate_publish_is_dropped_by_msg_id(bus: Bus) -> None:
    env = codec.wrap(submitted(1))
    first = await bus.publish(env)
    again = await bus.publish(env)
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    assert await bus.last_seq() == 1


async def test_expected_last_subject_sequence_conflict(bus: Bus) -> None:
    await bus.publish(submitted(1))
    subject = bus.names.subject(submitted(1))
    assert await bus.last_subject_seq(subject) == 1
    # Two writers both read seq 1 and race to append; exactly one wins.
    ok = await bus.publish(ev.JobStarted(job_id="j1"), expected_last_subject_seq=0)
    assert ok.seq == 2
    with pytest.raises(ConcurrencyConflict, match="wrong last sequence"):
        await bus.publish(ev.JobStarted(job_id="j1"), expected_last_subject_seq=0)
    assert await bus.last_seq() == 2


async def test_replay_from_sequence_and_from_time(bus: Bus) -> None:
    early = [codec.wrap(submitted(i)) for i in range(10)]
    await bus.publish_many(early)
    # The server stamps messages; wait until the clock has visibly moved on.
    mark = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.05)
    late = [codec.wrap(submitted(i)) for i in range(10, 15)]
    await bus.publish_many(late)
    from_seq = [env async for _, env in bus.replay(start_seq=8)]
    assert from_seq == early[7:] + late
    from_time = [env async for _, env in bus.replay(start_time=mark)]
    assert from_time == late


async def test_replay_then_follow_has_no_gap_and_no_duplicate(bus: Bus) -> None:
    """History and live tail come from one consumer: every seq exactly once, in order."""
    await bus.publish_many([submitted(i) for i in range(300)])
    stop = asyncio.Event()
    seen: list[int] = []

    async def reader() -> None:
        async for batch in bus.replay_batches(follow=True, batch=64, stop=stop, idle_expires_s=0.2):
            seen.extend(seq for seq, _ in batch)
            if len(seen) >= 600:
                stop.set()

    task = asyncio.create_task(reader())
    for k in range(6):  # live writes while the reader is replaying / tailing
        await bus.publish_many([submitted(1000 + k * 50 + i) for i in range(50)])
    await asyncio.wait_for(task, 20)
    assert seen == list(range(1, 601))


async def test_fold_from_log_equals_fold_in_memory(bus: Bus) -> None:
    envs = [codec.wrap(submitted(i), at=1000.0 + i) for i in range(50)]
    envs.append(codec.wrap(ev.SharesDecided(epoch=1, shares={f"j{i}": 1 for i in range(50)}), at=2000.0))
    envs.append(codec.wrap(ev.JobCompleted(job_id="j3", iterations=100), at=2100.0))
    await bus.publish_many(envs)
    replayed, last = await fold_log(bus, st.ClusterState(), st.apply)
    assert last == len(envs)
    assert st.digest(replayed) == st.digest(st.fold(envs))
    assert replayed.jobs["j3"].attained_service_gpu_s == pytest.approx(100.0)


async def test_leader_lease_is_exclusive_and_expires(bus: Bus) -> None:
    a = await bus.lease("allocator", "a", ttl_s=1.0)
    b = await bus.lease("allocator", "b", ttl_s=1.0)
    assert await a.try_acquire()
    assert not await b.try_acquire()
    assert await a.renew()
    assert await a.holder_now() == "a"
    # a stops renewing (e.g. killed): b gets the lease once the TTL lapses.
    deadline = asyncio.get_running_loop().time() + 10
    while not await b.try_acquire():
        assert asyncio.get_running_loop().time() < deadline, "lease never lapsed"
        await asyncio.sleep(0.1)
    assert not await a.renew(), "a stale holder must not be able to renew"
    await b.release()
    assert await a.try_acquire()


async def test_a_lease_of_another_ttl_than_the_bucket_is_refused(bus: Bus) -> None:
    """One lease bucket per installation (its name, without the TTL, is what the NATS
    permissions name): a process configured with another SHOAL_LEASE_TTL_S would renew
    too rarely for the bucket, so it gets a clear error instead of a lease."""
    from shoal.bus import BusError

    await bus.lease("allocator", "a", ttl_s=3.0)
    with pytest.raises(BusError, match=r"keeps leases 3.0 s, but this process was given a 1.0 s lease"):
        await bus.lease("placer", "b", ttl_s=1.0)
    assert (await bus.lease("placer", "b", ttl_s=3.0)).ttl_s == 3.0


async def test_a_lease_write_nobody_answers_is_no_lease_and_no_crash(bus: Bus) -> None:
    """While the bucket's stream has no leader (here: no stream at all) a lease write
    meets no responders: acquiring and renewing say no instead of raising, so a service
    starting against a forming cluster keeps campaigning, and a leader stops leading."""
    from shoal.bus import Campaign

    a = Campaign(await bus.lease("profiler", "a", ttl_s=1.0))
    assert await a.poll() == "elected"
    await bus.js.delete_stream(f"KV_{a.lease.kv._name}")
    a.next_due = 0.0
    assert await a.poll() == "lost" and not a.is_leader
    a.next_due = 0.0
    assert await a.poll() is None and not a.is_leader
    # Once the bucket is back, the next poll leads again.
    b = await bus.lease("profiler", "b", ttl_s=1.0)
    assert await b.try_acquire()
    await b.release()
    a.next_due = 0.0
    assert await a.poll() == "elected"


async def test_campaign_paused_past_its_ttl_is_no_leader_before_it_polls(bus: Bus) -> None:
    from shoal.bus import Campaign

    a = Campaign(await bus.lease("placer", "a", ttl_s=1.0))
    assert await a.poll() == "elected" and a.is_leader
    time.sleep(1.2)  # the fault itself: this event loop stalls past the TTL, as under SIGSTOP
    assert not a.is_leader, "a holder whose TTL ran out still says it leads"
    b = Campaign(await bus.lease("placer", "b", ttl_s=1.0))
    deadline = asyncio.get_running_loop().time() + 10
    while await b.poll() != "elected":
        assert asyncio.get_running_loop().time() < deadline, "lease never lapsed"
        await asyncio.sleep(0.1)
    assert not a.is_leader
    assert await a.poll() == "lost" and not a.is_leader and b.is_leader


async def test_snapshot_roundtrip(bus: Bus) -> None:
    assert await bus.load_snapshot("allocator") is None
    state = st.fold([codec.wrap(submitted(i), at=float(i)) for i in range(20)])
    await bus.save_snapshot("allocator", 20, st.encode_state(state), digest=st.digest(state))
    snap = await bus.load_snapshot("allocator")
    assert snap is not None and snap.seq == 20
    assert st.digest(st.decode_state(snap.state)) == snap.digest == st.digest(state)


async def test_snapshot_read_is_bounded_when_its_chunks_vanish(bus: Bus) -> None:
    """A writer replacing a snapshot purges the old version's chunks; a reader that
    had the old metadata must not wait for them for ever (nats-py's get would). Here
    the chunks are purged by hand, so every read finds metadata without data."""
    state = st.fold([codec.wrap(submitted(i), at=float(i)) for i in range(20)])
    await bus.save_snapshot("allocator", 20, st.encode_state(state), digest=st.digest(state))
    store = await bus.js.object_store(bus.names.snapshot_bucket)
    info = await store.get_info("allocator")
    await bus.js.purge_stream(
        f"OBJ_{bus.names.snapshot_bucket}", subject=f"$O.{bus.names.snapshot_bucket}.C.{info.nuid}"
    )
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await bus.load_snapshot("allocator", timeout_s=0.5, attempts=2)
    assert time.monotonic() - started < 5


async def test_trace_context_travels_in_headers(bus: Bus) -> None:
    """A publish inside a span carries its W3C traceparent; the consumer continues that trace."""
    from nats.aio.msg import Msg
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("decide") as span:
        await bus.publish(submitted(1))
        want = span.get_span_context().trace_id
    seen: list[int] = []
    stop = asyncio.Event()

    async def handler(env: Envelope, msg: Msg) -> None:
        assert msg.headers and msg.headers["traceparent"].split("-")[1] == f"{want:032x}"
        seen.append(trace.get_current_span().get_span_context().trace_id)
        stop.set()

    await bus.ensure_consumer("traced")
    await asyncio.wait_for(bus.consume("traced", handler, stop=stop, fetch_timeout_s=0.2), 10)
    assert seen == [want]

"""Poison messages on the event log (issue 20): whatever is published on a subject the
event stream captures, no reader stops, the fold skips it, it is counted and stored in
the dead-letter stream once with its reason, and no writer's expected-sequence cursor
is left behind by it. Real nats-server, real allocator and placer in-process."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Batch, Bus, Header, fold_log
from shoal.clock import WallClock
from shoal.projection import Projection
from shoal_services.allocator.service import AllocatorService
from shoal_services.placer.service import PlacerService

from tests.services.test_allocator_placer import GreedyRequested, job, node, wait_until
from tests.test_bad_input import wait_dead_letters

pytestmark = pytest.mark.integration


def envelope_bytes(type_: str, event: dict[str, object], *, v: int = 1, id_: str = "01POISON") -> bytes:
    return msgspec.msgpack.encode(
        {"id": id_, "type": type_, "v": v, "at": 1.0, "event": {"type": type_, **event}}
    )


def poison(prefix: str) -> list[tuple[str, bytes, str, str]]:
    """(subject, data, code, a word of the reason) for each kind of bad message."""
    return [
        # 0xc1 is never used in msgpack: garbage whatever the random rest is.
        (f"{prefix}.alloc.shares_decided", b"\xc1" + os.urandom(31), "malformed", "not a msgpack envelope"),
        (
            f"{prefix}.job.j1.submitted",
            envelope_bytes("job.submitted", {"job_id": "j1", "spec": {"user": "alice", "min_gpus": -3}}),
            "malformed",
            "$.event.spec.min_gpus",
        ),
        (
            f"{prefix}.job.j1.teleported",
            envelope_bytes("job.teleported", {"to": "mars"}),
            "unknown_type",
            "teleported",
        ),
        (
            f"{prefix}.node.n0.registered",
            envelope_bytes("node.registered", {"node_id": "n0", "gpus": []}, v=7),
            "future_version",
            "version 7",
        ),
        (
            f"{prefix}.trade.executed",
            envelope_bytes("trade.executed", {"trade_id": "t1", "surprise": True}, v=2),
            "future_version",
            "version 2",
        ),
        # Valid events on a subject that is not their own: an identity allowed one
        # subject (node n0's registration, job j1's completion) puts another event there.
        (
            f"{prefix}.node.n0.registered",
            codec.encode(codec.wrap(ev.SharesDecided(epoch=10**6, shares={"a": 64}))),
            "wrong_subject",
            "alloc.shares_decided",
        ),
        (
            f"{prefix}.node.n0.registered",
            codec.encode(codec.wrap(ev.NodeRegistered(node_id="fake", gpus=()))),
            "wrong_subject",
            "node.fake.registered",
        ),
        (
            f"{prefix}.job.j1.completed",
            codec.encode(codec.wrap(ev.JobCompleted(job_id="a"))),
            "wrong_subject",
            "job.a.completed",
        ),
        # A well-formed envelope whose string holds bytes that are not UTF-8: msgspec
        # before 0.23 raises UnicodeDecodeError there, which is neither of its own errors.
        (
            f"{prefix}.job.j1.cancelled",
            envelope_bytes("job.cancelled", {"job_id": "j1", "reason": "REASON"}).replace(
                b"REASON", b"RE\xff\xfeON"
            ),
            "malformed",
            "UTF-8",
        ),
    ]


def test_future_schema_version_is_not_decoded_as_the_current_one() -> None:
    good = codec.encode(codec.wrap(ev.NodeRegistered(node_id="n0", gpus=())))
    assert codec.decode(good).v == 1
    newer = envelope_bytes("node.registered", {"node_id": "n0", "gpus": []}, v=2)
    with pytest.raises(codec.FutureVersion, match="version 2 is newer than this reader's version 1"):
        codec.decode(newer)
    # A newer version whose payload this reader could not even read is still a newer
    # version, not a malformed message.
    with pytest.raises(codec.FutureVersion):
        codec.decode(envelope_bytes("node.registered", {"node_id": 5}, v=3))
    assert issubclass(codec.FutureVersion, codec.UnknownEventType)


async def test_replay_skips_counts_and_dead_letters_each_bad_message_once(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    good = [node("n0"), job("a", 2), job("b", 1)]
    bad = poison(prefix)
    seqs: list[int] = []
    await bus.publish(good[0])
    for subject, data, _, _ in bad:
        seqs.append((await bus.publish_raw(subject, data)).seq)
    await bus.publish_many(good[1:])
    last = await bus.last_seq()

    skipped = []
    folded = st.ClusterState()
    async for batch in bus.replay_batches(dead_letter=True):
        assert isinstance(batch, Batch)
        skipped += batch.skipped
        for _, env in batch:
            st.apply(folded, env)
        final = batch.last_seq
    assert final == last
    # The fold saw exactly the good events.
    expected = st.ClusterState()
    for e in good:
        st.apply_event(expected, e, 0.0)
    assert sorted(folded.jobs) == ["a", "b"] and sorted(folded.nodes) == ["n0"]
    assert folded.jobs["a"].spec == expected.jobs["a"].spec
    assert [(s.seq, s.subject, s.code) for s in skipped] == [
        (seq, s, code) for seq, (s, _, code, _) in zip(seqs, bad, strict=True)
    ]
    assert bus.stats.malformed_skipped == 6 and bus.stats.unknown_skipped == 3
    assert bus.stats.dead_lettered == 9
    assert "a" in folded.jobs and folded.jobs["a"].status != st.COMPLETED
    assert "fake" not in folded.nodes and not folded.shares

    letters = await wait_dead_letters(bus, 9)
    by_seq = {h[Header.DLQ_STREAM_SEQ]: (h, data) for h, data in letters}
    for seq, (subject, data, code, word) in zip(seqs, bad, strict=True):
        headers, stored = by_seq[str(seq)]
        assert headers[Header.DLQ_SUBJECT] == subject
        assert headers[Header.DLQ_CODE] == code
        assert word in headers[Header.DLQ_REASON], headers
        assert headers[Header.DLQ_CONSUMER] == "replay"
        assert stored == data

    # Another process replaying the same log (and this one again) stores nothing more.
    other = await Bus.connect(nats_url, prefix=prefix, creds=os.environ["NATS_CREDS"])
    try:
        state, seen = await fold_log(other, st.ClusterState(), st.apply)
        assert seen == last and sorted(state.jobs) == ["a", "b"]
        async for _ in other.replay_batches(dead_letter=True):
            pass
        assert other.stats.malformed_skipped == 12 and other.stats.dead_lettered == 0
    finally:
        await other.close()
    async for _ in bus.replay_batches(dead_letter=True):
        pass
    assert bus.stats.dead_lettered == 9
    assert len(await bus.dead_letters()) == 9


async def test_a_live_bad_message_reaches_skip_listeners_at_once(bus: Bus) -> None:
    """Following the live tail, a batch holding only a skipped message is handed over
    (not held until the next good event), in log order with the events."""
    seen: list[tuple[str, int]] = []
    proj = Projection(
        bus,
        listeners=[lambda seq, env, state: seen.append((env.type, seq))],
        skip_listeners=[lambda s: seen.append((s.code, s.seq))],
    )
    await proj.start()
    try:
        await proj.wait_ready()
        first = await bus.publish(node("n0"))
        garbage = await bus.publish_raw(f"{bus.names.prefix}.alloc.shares_decided", os.urandom(32))
        await wait_until(lambda: len(seen) == 2)
        assert seen == [("node.registered", first.seq), ("malformed", garbage.seq)]
        assert proj.last_seq == garbage.seq
        await wait_dead_letters(bus, 1)
    finally:
        await proj.stop()


async def test_allocator_decides_after_garbage_on_its_decision_subject(bus: Bus) -> None:
    """The attack of issue 20, in-process: 32 random bytes on the decision subject,
    then a job: it gets its share and its GPUs promptly."""
    stop = asyncio.Event()
    alloc = AllocatorService(bus, GreedyRequested(), holder="a1", clock=WallClock(), node_timeout_s=None)
    placer = PlacerService(bus, holder="p1", clock=WallClock())
    tasks = [asyncio.create_task(alloc.run(stop)), asyncio.create_task(placer.run(stop))]
    try:
        await bus.publish_many([node("n0"), job("a", 2)])
        await wait_until(lambda: "a" in placer.projection.state.placed)
        for subject in ("alloc.shares_decided", "alloc.placement_decided"):
            await bus.publish_raw(f"{bus.names.prefix}.{subject}", os.urandom(32))
        await bus.publish(job("b", 2))
        await wait_until(lambda: "b" in placer.projection.state.placed, timeout=10)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
    assert len(await bus.dead_letters()) == 2


async def test_allocator_restore_reads_past_garbage(bus: Bus) -> None:
    """A restart finds garbage as the newest message on the decision subject (and more
    garbage before it): the cursor is the garbage's sequence, the decision instant the
    newest decision that decodes."""
    await bus.publish_many([node("n0"), job("a", 2)])
    decision = codec.wrap(
        ev.SharesDecided(epoch=1, shares={"a": 2}, policy="greedy-requested", trigger="arrival"), at=1234.5
    )
    await bus.publish(decision, expected_last_subject_seq=0)
    subject = f"{bus.names.prefix}.alloc.shares_decided"
    # Enough other events between to make the restore walk back more than one window.
    await bus.publish_many([ev.NodeHeartbeat(node_id="n0") for _ in range(600)])
    await bus.publish_raw(subject, os.urandom(32))
    await bus.publish_many([ev.NodeHeartbeat(node_id="n0") for _ in range(300)])
    garbage = await bus.publish_raw(subject, envelope_bytes("alloc.shares_decided", {"epoch": 2}, v=9))
    alloc = AllocatorService(bus, GreedyRequested(), holder="a1", clock=WallClock(), node_timeout_s=None)
    await alloc._restore_decision_cursor()
    assert alloc.decisions_seq == garbage.seq
    assert alloc.last_decision_at == 1234.5
    assert await bus.last_valid_on_subject(f"{bus.names.prefix}.alloc.nothing_here") == (0, None)


async def test_a_job_id_whose_subject_holds_only_garbage_can_still_be_submitted(bus: Bus) -> None:
    subject = f"{bus.names.prefix}.job.j1.submitted"
    garbage = await bus.publish_raw(subject, os.urandom(32))
    result = await bus.publish_first(job("j1", 1))
    assert result.seq > garbage.seq
    # Once a submission that decodes is there, a second one is refused.
    from shoal.bus import ConcurrencyConflict

    with pytest.raises(ConcurrencyConflict):
        await bus.publish_first(job("j1", 1))

"""Bad input on the bus: each case gets a specific error or a dead letter with its
reason, the consumer keeps going, and the folded state is unchanged by what was rejected."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.msg import Msg
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, ConcurrencyConflict, Header, PermanentError, PublishRejected
from shoal.events import MAX_MESSAGE_BYTES, Envelope

pytestmark = pytest.mark.integration


class FoldingConsumer:
    """A durable consumer that folds what it receives, like every service does."""

    def __init__(self, bus: Bus, name: str = "folder", max_deliver: int = 3) -> None:
        self.bus = bus
        self.name = name
        self.max_deliver = max_deliver
        self.state = st.ClusterState()
        self.applied: list[str] = []
        self.stop = asyncio.Event()
        self.fail_ids: dict[str, Exception] = {}

    async def handler(self, env: Envelope, msg: Msg) -> None:
        if env.id in self.fail_ids:
            raise self.fail_ids[env.id]
        st.apply(self.state, env)
        self.applied.append(env.id)

    async def __aenter__(self) -> FoldingConsumer:
        await self.bus.ensure_consumer(self.name, max_deliver=self.max_deliver, ack_wait_s=5)
        self.task = asyncio.create_task(
            self.bus.consume(
                self.name,
                self.handler,
                stop=self.stop,
                fetch_timeout_s=0.2,
                max_deliver=self.max_deliver,
                retry_delay_s=0.05,
            )
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 10)

    async def wait_applied(self, event_id: str, timeout: float = 10) -> None:
        async def _wait() -> None:
            while event_id not in self.applied:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(_wait(), timeout)


async def wait_dead_letters(bus: Bus, n: int, timeout: float = 10) -> list[tuple[dict[str, str], bytes]]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        letters = await bus.dead_letters()
        if len(letters) >= n:
            return letters
        assert asyncio.get_running_loop().time() < deadline, f"only {len(letters)} dead letters"
        await asyncio.sleep(0.05)


def job(i: int) -> ev.JobSubmitted:
    return ev.JobSubmitted(job_id=f"j{i}", spec=ev.JobSpec(user="alice", total_iterations=10))


@pytest.fixture
async def consumer(bus: Bus) -> AsyncIterator[FoldingConsumer]:
    async with FoldingConsumer(bus) as c:
        first = codec.wrap(job(0))
        await bus.publish(first)
        await c.wait_applied(first.id)
        yield c


async def after_bad_input_consumer_keeps_going(bus: Bus, consumer: FoldingConsumer, before: str) -> None:
    """The state was unchanged by the bad input, and the next good event is applied."""
    assert st.digest(consumer.state) == before
    good = codec.wrap(job(99))
    await bus.publish(good)
    await consumer.wait_applied(good.id)
    assert "j99" in consumer.state.jobs


async def test_garbage_bytes_are_dead_lettered(bus: Bus, consumer: FoldingConsumer) -> None:
    before = st.digest(consumer.state)
    await bus.publish_raw(f"{bus.names.prefix}.job.j1.submitted", b"\x00\xffnot msgpack at all\xc1")
    ((headers, data),) = await wait_dead_letters(bus, 1)
    assert headers[Header.DLQ_CODE] == "malformed"
    assert "msgpack" in headers[Header.DLQ_REASON] or "envelope" in headers[Header.DLQ_REASON]
    assert headers[Header.DLQ_SUBJECT] == f"{bus.names.prefix}.job.j1.submitted"
    assert data == b"\x00\xffnot msgpack at all\xc1"
    await after_bad_input_consumer_keeps_going(bus, consumer, before)


async def test_valid_envelope_with_invalid_payload_is_dead_lettered(
    bus: Bus, consumer: FoldingConsumer
) -> None:
    before = st.digest(consumer.state)
    bad = msgspec.msgpack.encode(
        {
            "id": "01BAD",
            "type": "job.submitted",
            "at": 1.0,
            "event": {"type": "job.submitted", "job_id": "j1", "spec": {"user": "alice", "min_gpus": -3}},
        }
    )
    await bus.publish_raw(f"{bus.names.prefix}.job.j1.submitted", bad)
    ((headers, _),) = await wait_dead_letters(bus, 1)
    assert headers[Header.DLQ_CODE] == "malformed"
    assert "invalid job.submitted payload" in headers[Header.DLQ_REASON]
    assert "$.event.spec.min_gpus" in headers[Header.DLQ_REASON]
    await after_bad_input_consumer_keeps_going(bus, consumer, before)


async def test_unknown_event_type_is_skipped_and_counted(bus: Bus, consumer: FoldingConsumer) -> None:
    before = st.digest(consumer.state)
    future = msgspec.msgpack.encode(
        {
            "id": "01NEW",
            "type": "job.teleported",
            "v": 7,
            "at": 1.0,
            "event": {"type": "job.teleported", "to": "mars"},
        }
    )
    await bus.publish_raw(f"{bus.names.prefix}.job.j1.teleported", future)
    await after_bad_input_consumer_keeps_going(bus, consumer, before)
    assert bus.stats.unknown_skipped == 1
    assert await bus.dead_letters() == [], "an unknown type is not an error"


async def test_oversized_message_is_refused(bus: Bus, consumer: FoldingConsumer) -> None:
    before = st.digest(consumer.state)
    huge = ev.JobSubmitted(
        job_id="big", spec=ev.JobSpec(user="alice", total_iterations=1, env={"X": "y" * MAX_MESSAGE_BYTES})
    )
    # The sender gets a specific error and nothing is sent ...
    with pytest.raises(codec.MessageTooLarge, match="limit is 262144"):
        await bus.publish(huge)
    # ... and a writer that bypasses the bus is refused by the stream itself.
    with pytest.raises(PublishRejected, match="maximum"):
        await bus.publish_raw(f"{bus.names.prefix}.job.big.submitted", b"x" * (MAX_MESSAGE_BYTES + 1))
    assert await bus.last_seq() == 1
    await after_bad_input_consumer_keeps_going(bus, consumer, before)


async def test_duplicate_publish_changes_nothing(bus: Bus, consumer: FoldingConsumer) -> None:
    env = codec.wrap(job(5))
    await bus.publish(env)
    await consumer.wait_applied(env.id)
    before = st.digest(consumer.state)
    again = await bus.publish(env)
    assert again.duplicate
    await after_bad_input_consumer_keeps_going(bus, consumer, before)
    assert consumer.applied.count(env.id) == 1


async def test_conflicting_expected_sequence_is_refused(bus: Bus, consumer: FoldingConsumer) -> None:
    before = st.digest(consumer.state)
    stale = codec.wrap(ev.JobCancelled(job_id="j0", reason="stale writer"))
    with pytest.raises(ConcurrencyConflict) as info:
        await bus.publish(stale, expected_last_subject_seq=12345)
    assert info.value.err_code == 10071
    await after_bad_input_consumer_keeps_going(bus, consumer, before)
    assert consumer.state.jobs["j0"].status == st.PENDING


async def test_handler_permanent_error_and_exhausted_retries(bus: Bus, consumer: FoldingConsumer) -> None:
    poison = codec.wrap(job(7))
    flaky = codec.wrap(job(8))
    consumer.fail_ids[poison.id] = PermanentError("job j7 references a user that does not exist")
    consumer.fail_ids[flaky.id] = RuntimeError("database down")
    before = st.digest(consumer.state)
    await bus.publish_many([poison, flaky])
    letters = await wait_dead_letters(bus, 2, timeout=15)
    codes = sorted(h[Header.DLQ_CODE] for h, _ in letters)
    assert codes == ["max_deliver", "permanent"]
    reasons = " ".join(h[Header.DLQ_REASON] for h, _ in letters)
    assert "does not exist" in reasons and "failed 3 times" in reasons
    await after_bad_input_consumer_keeps_going(bus, consumer, before)

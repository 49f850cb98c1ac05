"""A handler slower than the consumer's ack_wait is kept alive, not redelivered.

``Bus._handle`` runs a keep-alive task that sends ``in_progress`` (``+WPI``) every
``ack_wait / 3`` while the handler works. These tests run against a real nats-server
with a 1 s ack_wait and a handler that takes 2.5 s:

* with the keep-alive, the message is handled exactly once, acked, and never handed to
  a rival puller on the same durable consumer;
* with the keep-alive switched off (the control), the server does redeliver it to that
  rival after ack_wait -- which shows that the first test would notice a broken
  keep-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import pytest
from nats.aio.msg import Msg
from shoal import events as ev
from shoal.bus import Bus
from shoal.events import Envelope

pytestmark = pytest.mark.integration

ACK_WAIT_S = 1.0
HANDLER_S = 2.5  # 2.5 x ack_wait
QUIET_AFTER_S = 1.5  # keep watching for a redelivery after the ack


async def _rival(bus: Bus, durable: str, stop: asyncio.Event, got: list[int]) -> None:
    """A second puller on the same durable: records (and acks) anything it is handed."""
    psub = await bus.js.pull_subscribe_bind(durable, stream=bus.names.events_stream)
    try:
        while not stop.is_set():
            try:
                msgs = await psub.fetch(1, timeout=0.2)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            for msg in msgs:
                got.append(msg.metadata.num_delivered or 0)
                await msg.ack()
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()


async def _run_slow(bus: Bus, durable: str) -> tuple[list[int], list[int], float]:
    """Publish one event and consume it with a slow handler while a rival pulls too.

    Returns (num_delivered seen by each handler call, num_delivered of each rival
    delivery, seconds the handler took)."""
    await bus.declare()
    await bus.ensure_consumer(durable, ack_wait_s=ACK_WAIT_S, max_deliver=5)
    await bus.publish(ev.JobSubmitted(job_id="slow1", spec=ev.JobSpec(user="alice", total_iterations=1)))

    calls: list[int] = []
    rival_got: list[int] = []
    done = asyncio.Event()
    stop = asyncio.Event()
    took = 0.0

    async def handler(env: Envelope, msg: Msg) -> None:
        nonlocal took
        calls.append(msg.metadata.num_delivered or 0)
        t0 = time.monotonic()
        await asyncio.sleep(HANDLER_S)
        took = time.monotonic() - t0
        done.set()

    consumer = asyncio.create_task(
        bus.consume(
            durable,
            handler,
            stop=stop,
            fetch_timeout_s=0.2,
            max_deliver=5,
            ack_wait_s=ACK_WAIT_S,
        )
    )
    rival = asyncio.create_task(_rival(bus, durable, stop, rival_got))
    try:
        await asyncio.wait_for(done.wait(), HANDLER_S + 5)
        await asyncio.sleep(QUIET_AFTER_S)  # a redelivery would show up here
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(consumer, rival), 5)
    return calls, rival_got, took


async def test_slow_handler_is_kept_alive_and_handled_exactly_once(bus: Bus) -> None:
    durable = "slow"
    calls, rival_got, took = await _run_slow(bus, durable)

    assert took >= 2 * ACK_WAIT_S  # the handler really outlived ack_wait
    assert calls == [1], f"handler ran {len(calls)} times (num_delivered {calls})"
    assert rival_got == [], f"message was redelivered to a rival puller: {rival_got}"
    assert bus.stats.handled == 1
    info = await bus.js.consumer_info(bus.names.events_stream, durable)
    assert info.num_ack_pending == 0  # acked
    assert info.num_redelivered == 0
    assert info.delivered.consumer_seq == 1  # one delivery in all
    assert info.ack_floor.stream_seq == 1


async def test_without_keep_alive_the_server_redelivers(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the same run with the keep-alive disabled is redelivered after ack_wait."""

    async def no_keep_alive(msg: Msg, ack_wait_s: float) -> None:
        return None

    monkeypatch.setattr(Bus, "_keep_alive", staticmethod(no_keep_alive))
    calls, rival_got, _ = await _run_slow(bus, "slow_ctl")

    assert calls == [1]
    assert rival_got and rival_got[0] >= 2, f"expected a redelivery to the rival, got {rival_got}"

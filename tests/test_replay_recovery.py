"""A replay's ephemeral consumer that the server forgot (deleted, server restarted) is
created again from the next sequence: the replay goes on without gap or duplicate."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats


def submitted(i: int) -> ev.JobSubmitted:
    return ev.JobSubmitted(job_id=f"j{i}", spec=ev.JobSpec(user="alice", total_iterations=100))


async def _wait_until(predicate: object, timeout_s: float = 15.0) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


async def _consumers(bus: Bus) -> list[str]:
    return [c.name for c in await bus.js.consumers_info(bus.names.events_stream)]


async def test_deleted_consumer_is_recreated_from_the_next_sequence(nats_url: str, prefix: str) -> None:
    creds = os.environ["NATS_CREDS"]
    reader_bus = await Bus.connect(nats_url, prefix=prefix, creds=creds)
    admin = await Bus.connect(nats_url, prefix=prefix, creds=creds, declare=False)
    try:
        await admin.publish_many([submitted(i) for i in range(300)])
        seen: list[int] = []
        stop = asyncio.Event()

        async def reader() -> None:
            async for batch in reader_bus.replay_batches(
                follow=True, batch=64, stop=stop, idle_expires_s=0.2
            ):
                seen.extend(seq for seq, _ in batch)

        task = asyncio.create_task(reader())
        await _wait_until(lambda: len(seen) >= 300)
        (first,) = await _consumers(admin)
        await admin.js.delete_consumer(admin.names.events_stream, first)
        # Written while the reader has no consumer: the new one must start right after 300.
        await admin.publish_many([submitted(i) for i in range(300, 400)])
        await _wait_until(lambda: len(seen) >= 400)
        (second,) = await _consumers(admin)
        assert second != first
        # And it keeps following the live tail.
        await admin.publish_many([submitted(i) for i in range(400, 450)])
        await _wait_until(lambda: len(seen) >= 450)
        stop.set()
        await asyncio.wait_for(task, 10)
        assert seen == list(range(1, 451))
    finally:
        await reader_bus.close()
        await admin.close()


async def test_replay_survives_a_server_restart_on_the_same_port(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    try:
        url = server.url
        reader_bus = await Bus.connect(url, prefix="rr")
        writer = await Bus.connect(url, prefix="rr")
        try:
            await writer.publish_many([submitted(i) for i in range(100)])
            seen: list[int] = []
            stop = asyncio.Event()

            async def reader() -> None:
                async for batch in reader_bus.replay_batches(follow=True, stop=stop, idle_expires_s=0.2):
                    seen.extend(seq for seq, _ in batch)

            task = asyncio.create_task(reader())
            await _wait_until(lambda: len(seen) >= 100)
            server.kill()
            server.restart()
            assert server.url == url
            await _wait_until(lambda: writer.nc.is_connected)
            await writer.publish_many([submitted(i) for i in range(100, 150)])
            await _wait_until(lambda: len(seen) >= 150, timeout_s=30)
            stop.set()
            await asyncio.wait_for(task, 10)
            assert seen == list(range(1, 151))
        finally:
            await reader_bus.close()
            await writer.close()
    finally:
        server.stop()


async def test_a_slow_replay_is_waited_for_and_a_stuck_one_is_not(bus: Bus) -> None:
    """``Projection.wait_ready`` gives up only on a replay that folds nothing for its
    timeout: one that keeps folding (a long log, a loaded machine) is waited for."""
    import time

    from shoal.projection import Projection

    from tests.services.test_allocator_placer import job

    # More than one replay batch (8,192): between two batches the wait's timeout fires.
    n = 9_000
    await bus.publish_many([codec.wrap(job(f"j{i}", 1), at=float(i)) for i in range(n)])
    projection = Projection(bus)
    # Each fold takes 0.6 ms: the first batch alone takes about 5 s, past a 2 s timeout.
    # (With a 0.5 s timeout, fetching the first batch before any fold took longer than
    # that on a loaded CI machine: a replay that has folded nothing yet *is* stuck by
    # this rule, so the timeout must be longer than a fetch.)
    projection.add_listener(lambda *_: time.sleep(0.0006))
    await projection.start()
    try:
        await projection.wait_ready(timeout_s=2.0)
        assert projection.last_seq == n
    finally:
        await projection.stop()
    # Never started, so it folds nothing and is never ready: the timeout still ends the wait.
    stuck = Projection(bus)
    with pytest.raises(TimeoutError):
        await stuck.wait_ready(timeout_s=0.2)


@pytest.mark.integration
async def test_a_projection_started_before_its_stream_exists_waits_for_it(nats_url: str, prefix: str) -> None:
    """An identity that may not create streams (the authorizer, a node daemon) can start
    before whoever declares them: its projection waits, not ready, and is ready once the
    stream exists. (CI's compose stack lost its authorizer to this: it exited on 'stream
    not found' and podman did not restart it.)"""
    from shoal.projection import Projection

    early = await Bus.connect(nats_url, prefix=prefix, creds=os.environ["NATS_CREDS"], declare=False)
    projection = Projection(early)
    starting = asyncio.create_task(projection.start())
    try:
        await asyncio.sleep(0.5)  # time for a few retries; nothing to wait *for* yet
        assert not starting.done()
        declarer = await Bus.connect(nats_url, prefix=prefix, creds=os.environ["NATS_CREDS"])
        try:
            await declarer.publish(ev.UserRegistered(user="alice"))
            await asyncio.wait_for(starting, 10)
            await asyncio.wait_for(projection.wait_ready(), 10)
            assert "alice" in projection.state.users
        finally:
            await declarer.close()
    finally:
        if not starting.done():
            starting.cancel()
        await projection.stop()
        await early.close()

"""A replay's ephemeral consumer that the server forgot (deleted, server restarted) is
created again from the next sequence: the replay goes on without gap or duplicate."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

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


async def _wait_until_async(read: Any, expected: object, timeout_s: float) -> None:
    async def poll() -> None:
        while await read() != expected:
            await asyncio.sleep(0.1)

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
    # Each fold takes 2 ms: the first batch alone takes at least 16 s, past a 10 s
    # timeout. (A replay that has folded nothing yet *is* stuck by this rule, so the
    # timeout must be longer than fetching the first batch: on a loaded CI machine that
    # took longer than 0.5 s, and once longer than 2 s.)
    projection.add_listener(lambda *_: time.sleep(0.002))
    await projection.start()
    try:
        await projection.wait_ready(timeout_s=10.0)
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


class _Partition:
    """A TCP proxy between one client and the server that can hold everything in both
    directions for a while: a network partition. What the client sent meanwhile reaches
    the server at once when it heals, as a paused server's socket backlog would, but the
    server itself kept running, so its consumer timers fired on time."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.healed = asyncio.Event()
        self.healed.set()
        self.tasks: list[asyncio.Task[None]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.tasks += [
            asyncio.create_task(self._pump(client_r, server_w)),
            asyncio.create_task(self._pump(server_r, client_w)),
        ]

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                await self.healed.wait()
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server is not None:
            self.server.close()


async def test_replay_recovers_once_from_the_backlog_of_a_partition(tmp_path: Path) -> None:
    """Cut off from the server for longer than its consumer's inactive threshold, a
    reader's consumer is removed, and every pull request it sent meanwhile reaches the
    server at once when the partition heals (as the backlog of a server paused past the
    threshold does): each is answered "no such consumer". Those answers belong to the
    lost consumer; read as the recreated one's, each lost it again. Issue 21's 60 s pause
    suite found a standby hundreds of events behind the tail after such a pause, for good.
    The reader must recover in one episode, with no gap or duplicate, and follow on.

    The threshold is 1 s here instead of 30 s, so a partition of about 10 s does: the
    reader sends a pull about every 7.5 s of silence (an idle long-poll of 0.2 s plus 5 s
    grace, then a 2 s consumer-info timeout), so two are waiting when it heals. (A SIGSTOP of the
    server itself raced the server's timer against its backlog: a third of the runs kept
    the consumer.)"""
    from structlog.testing import capture_logs

    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    partition = _Partition(int(server.url.rsplit(":", 1)[1]))
    try:
        reader_bus = await Bus.connect(await partition.start(), prefix="rp")
        writer = await Bus.connect(server.url, prefix="rp")
        try:
            await writer.publish_many([submitted(i) for i in range(100)])
            seen: list[int] = []
            stop = asyncio.Event()

            async def reader() -> None:
                async for batch in reader_bus.replay_batches(
                    follow=True, stop=stop, idle_expires_s=0.2, inactive_threshold_s=1.0
                ):
                    seen.extend(seq for seq, _ in batch)

            with capture_logs() as logs:
                task = asyncio.create_task(reader())
                try:
                    await _wait_until(lambda: len(seen) >= 100)
                    partition.healed.clear()
                    # The server removes the consumer once its last pull request expired and
                    # the threshold passed, whatever the reader sent meanwhile.
                    await _wait_until_async(lambda: _consumers(writer), [], timeout_s=15)
                    await writer.publish_many([submitted(i) for i in range(100, 150)])
                    await asyncio.sleep(8)  # a pull per 7.5 s of silence: one more queued up
                    partition.healed.set()
                    await _wait_until(lambda: len(seen) >= 150, timeout_s=30)
                    # Still following once the stale answers are all in: nothing loses it again.
                    await asyncio.sleep(2)
                    await writer.publish_many([submitted(i) for i in range(150, 200)])
                    await _wait_until(lambda: len(seen) >= 200, timeout_s=15)
                    stop.set()
                    await asyncio.wait_for(task, 10)
                finally:
                    partition.healed.set()
                    task.cancel()
            assert seen == list(range(1, 201))
            events = [e["event"] for e in logs if e["event"].startswith("replay_consumer_")]
            assert events.count("replay_consumer_lost") == 1, events
            assert events.count("replay_consumer_recreated") == 1, events
        finally:
            await reader_bus.close()
            await writer.close()
    finally:
        await partition.close()
        server.stop()


async def test_a_replay_started_while_the_server_does_not_answer_waits_for_it(tmp_path: Path) -> None:
    """The first consumer's create is retried while the JetStream API does not answer
    in time (as during a cluster's leader election: the CI run where a replay right after
    a rolling restart failed on one 5 s timeout); a refusal that cannot clear is not."""
    import signal

    import nats.js.errors

    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    try:
        bus = await Bus.connect(server.url, prefix="rp")
        try:
            await bus.publish_many([submitted(i) for i in range(50)])
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            loop = asyncio.get_running_loop()
            # Continued after the first create's 5 s request timeout has passed.
            loop.call_later(6.5, server.proc.send_signal, signal.SIGCONT)
            started = loop.time()
            seen = [seq async for seq, _ in bus.replay()]
            assert loop.time() - started >= 6.5
            assert seen == list(range(1, 51))
            # No such stream: refused at once, not retried for create_timeout_s.
            other = await Bus.connect(server.url, prefix="nostream", declare=False)
            try:
                started = loop.time()
                with pytest.raises(nats.js.errors.NotFoundError):
                    async for _ in other.replay(create_timeout_s=30.0):
                        pass
                assert loop.time() - started < 5
            finally:
                await other.close()
        finally:
            await bus.close()
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()

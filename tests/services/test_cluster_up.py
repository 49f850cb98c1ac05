"""`shoal up` against a real 3-node NATS cluster given as a seed list in ``NATS_URL``:
the server leading the event stream is killed (``kill -9``) while jobs run and a client
keeps submitting (a load, one job every 0.2 s, each retried with its own id until
accepted, as a user's script would); the installation goes on; then a rolling restart
of all three servers, a job submitted and completed while each is down. Every accepted
job completes, none is submitted twice, and `shoal jobs` answers. In the default run:
issue 21's cluster tests through the command a user runs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.client import Client, CommandError, NoAdmissionError
from shoal.commands.run import CLI_ARGV as CLI
from shoal.nats_server import LocalCluster

from tests.services.test_up import usable_policy, wait_line
from tests.test_cluster import all_current, eventually

pytestmark = pytest.mark.integration

MAX_LOAD = 60
"""At most this many jobs of the load (one node of 2 GPUs runs them at time scale 20)."""


async def submit_until_accepted(client: Client, job_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.submit(ev.JobSpec(user="alice", max_gpus=1, total_iterations=20), job_id=job_id)
            return
        except (NoAdmissionError, TimeoutError, CommandError) as exc:
            # During the stream's leader election admission may answer log_refused
            # (nothing was written): a user retries.
            if isinstance(exc, CommandError) and exc.code != "log_refused":
                raise
            assert time.monotonic() < deadline, f"{job_id} not accepted within {timeout_s}s"
            await asyncio.sleep(0.2)


async def wait_completed(client: Client, job_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.status(job_id)).status == "completed":
                return
        except TimeoutError:
            # A JetStream request (the log's last sequence) unanswered during a leader
            # election: a user polling asks again.
            pass
        assert time.monotonic() < deadline, f"{job_id} not completed within {timeout_s}s"
        await asyncio.sleep(0.2)


def test_up_on_a_cluster_survives_killing_the_event_stream_leader(
    nats_cluster: LocalCluster, tmp_path: Path
) -> None:
    prefix = f"up{os.getpid()}"
    admin = os.environ["NATS_CREDS"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env.update(
        NATS_URL=nats_cluster.url, NATS_CREDS=admin, SHOAL_PREFIX=prefix, SHOAL_STATE_DIR=str(tmp_path / "s")
    )
    args = ["up", "--nodes", "1", "--gpus-per-node", "2", "--time-scale", "20", "--policy", usable_policy()]
    proc = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.err").open("w"),
        text=True,
        env=env,
        start_new_session=True,
    )

    accepted: list[str] = []

    async def load(client: Client, stop: asyncio.Event) -> None:
        """One job every 0.2 s until ``stop``, each retried with its own id (idempotent)."""
        while not stop.is_set() and len(accepted) < MAX_LOAD:
            job_id = f"load-{len(accepted)}"
            await submit_until_accepted(client, job_id, timeout_s=90)
            accepted.append(job_id)
            await asyncio.sleep(0.2)

    async def scenario() -> None:
        async with await Client.connect(nats_cluster.url, prefix, creds=admin) as client:
            events = await client.bus.js.stream_info(client.bus.names.events_stream)
            assert events.config.num_replicas == 3
            await submit_until_accepted(client, "before")
            await wait_completed(client, "before")
            assert events.cluster is not None and events.cluster.leader
            victim = nats_cluster.index_of(events.cluster.leader)
            stop = asyncio.Event()
            loader = asyncio.create_task(load(client, stop))
            await asyncio.sleep(2)  # the load runs before the kill, across it and after it
            kills_at = len(accepted)
            nats_cluster.kill(victim)
            try:
                await submit_until_accepted(client, "after")
                await wait_completed(client, "after")
                await asyncio.sleep(2)
            finally:
                stop.set()
                await loader
                nats_cluster.restart(victim)
            assert 0 < kills_at < len(accepted), (kills_at, accepted)
            # A rolling restart of all three under load: each server killed, a job
            # submitted and completed while it is down, then restarted and caught up.
            await eventually(lambda: all_current(client.bus), 60, "the killed leader caught up")
            stop = asyncio.Event()
            loader = asyncio.create_task(load(client, stop))
            try:
                for i in range(3):
                    nats_cluster.kill(i)
                    try:
                        await submit_until_accepted(client, f"roll-{i}")
                        await wait_completed(client, f"roll-{i}")
                    finally:
                        nats_cluster.restart(i)
                    await eventually(lambda: all_current(client.bus), 60, f"server {i + 1} caught up")
            finally:
                stop.set()
                await loader
            for job_id in accepted:
                await wait_completed(client, job_id, timeout_s=180)
            submitted = [
                env.event.job_id
                async for _, env in client.bus.replay()
                if isinstance(env.event, ev.JobSubmitted)
            ]
            assert sorted(submitted) == sorted(
                ["before", "after", "roll-0", "roll-1", "roll-2", *accepted]
            ), "a job lost or submitted twice"
            print(f"{len(accepted)} jobs under load, {kills_at} before the kill; all completed once")
        jobs = await asyncio.create_subprocess_exec(
            *CLI, "jobs", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(jobs.communicate(), 60)
        assert jobs.returncode == 0, err.decode()
        assert "before" in out.decode() and "after" in out.decode()

    try:
        wait_line(proc, "running", 60)
        asyncio.run(scenario())
        assert proc.poll() is None, "shoal up exited"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

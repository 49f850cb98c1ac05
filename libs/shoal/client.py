"""The Python SDK: submit and follow jobs.

    async with await Client.connect("nats://127.0.0.1:4222") as client:
        job_id = await client.submit(JobSpec(user="alice", model="resnet50", max_gpus=4,
                                             requested_gpus=2, total_iterations=10_000))
        async for env in client.job_events(job_id):
            print(env.type)

Commands go to the admission service by request/reply; reads come from the log
(a fold of it for ``jobs``/``status``, a filtered replay for ``job_events``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, fold_log


class CommandError(Exception):
    """The service rejected a command; ``code`` says why, ``errors`` lists each problem."""

    def __init__(self, reply: ev.CommandRejected) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.code = reply.code
        self.errors = reply.errors
        self.reply = reply


class Client:
    """A connection to one shoal installation."""

    def __init__(self, bus: Bus, *, timeout_s: float = 10.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s

    @classmethod
    async def connect(cls, url: str, prefix: str = "shoal", *, timeout_s: float = 10.0) -> Client:
        """Connect to NATS (the installation's streams must exist)."""
        return cls(
            await Bus.connect(url, prefix=prefix, name="shoal-client", declare=False), timeout_s=timeout_s
        )

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def command(self, cmd: Any) -> ev.CommandAccepted:
        """Send a command to admission and return its acceptance.

        Raises:
            CommandError: the command was rejected (nothing changed).
            TimeoutError: no admission service answered in time.
        """
        try:
            msg = await self.bus.nc.request(
                self.bus.names.cmd(cmd.name), codec.encode_command(cmd), timeout=self.timeout_s
            )
        except Exception as exc:  # nats raises its own timeout / no-responders errors
            if "timeout" in type(exc).__name__.lower() or "noresponders" in type(exc).__name__.lower():
                raise TimeoutError(
                    f"no admission service answered on {self.bus.names.cmd(cmd.name)}"
                ) from exc
            raise
        reply = codec.decode_reply(msg.data)
        if isinstance(reply, ev.CommandRejected):
            raise CommandError(reply)
        return reply

    async def submit(self, spec: ev.JobSpec, job_id: str | None = None) -> str:
        """Submit a job; returns its id. Idempotent when ``job_id`` is given."""
        return (await self.command(ev.SubmitJob(spec=spec, job_id=job_id))).id

    async def cancel(self, job_id: str, reason: str = "") -> None:
        await self.command(ev.CancelJob(job_id=job_id, reason=reason))

    async def set_tickets(self, user: str, tickets: int) -> None:
        await self.command(ev.SetTickets(user=user, tickets=tickets))

    async def state(self) -> st.ClusterState:
        """The cluster state now, folded from the log."""
        state, _ = await fold_log(self.bus, st.ClusterState(), st.apply)
        return state

    async def jobs(self) -> dict[str, st.JobState]:
        return (await self.state()).jobs

    async def status(self, job_id: str) -> st.JobState:
        """One job's folded state.

        Raises:
            KeyError: no such job.
        """
        jobs = await self.jobs()
        if job_id not in jobs:
            raise KeyError(f"no job {job_id!r}")
        return jobs[job_id]

    async def nodes(self) -> dict[str, st.NodeState]:
        return (await self.state()).nodes

    async def job_events(self, job_id: str, *, follow: bool = True) -> AsyncIterator[ev.Envelope]:
        """The job's events from its submission on; with ``follow``, until it ends."""
        stop = asyncio.Event()
        subjects = [f"{self.bus.names.prefix}.job.{job_id}.>"]
        async for batch in self.bus.replay_batches(follow=follow, filter_subjects=subjects, stop=stop):
            for _, env in batch:
                yield env
                if isinstance(env.event, ev.JobCompleted | ev.JobFailed | ev.JobCancelled | ev.JobRejected):
                    stop.set()
                    return

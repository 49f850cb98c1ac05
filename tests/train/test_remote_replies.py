"""The leader's side of cross-node worker starts against a follower that answers
garbage (a broken or compromised sidecar of the same job), over a real nats-server: a
start fails with a clear error, and the poller keeps running and counts the bad answers
as missed polls until the node's workers are declared lost, as a silent follower's are."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from shoal.bus import Bus
from shoal.events import GpuRef
from shoal.train.launch import LaunchRequest
from shoal_services.trainer_sidecar.remote import LOST, RemoteSpawnError, RemoteWorkers, SpawnReply, subject

pytestmark = pytest.mark.integration


async def test_a_follower_answering_garbage_ends_nothing_but_its_workers(bus: Bus) -> None:
    prefix, job = bus.names.prefix, "jg"
    answers = {"spawn": b"not json", "status": b'{"workers": "many"}'}

    async def follower(msg: object) -> None:
        action = msg.subject.rsplit(".", 1)[1]  # type: ignore[attr-defined]
        await msg.respond(answers.get(action, b"{}"))  # type: ignore[attr-defined]

    sub = await bus.nc.subscribe(subject(prefix, job, "n1", ">"), cb=follower)
    remote = RemoteWorkers(bus.nc, prefix, job, "leader-1", spawn_timeout_s=5, poll_s=0.1, lost_after=3)
    await remote.start()
    request = LaunchRequest(job_id=job, worker=1, gpu=GpuRef("n1", 0), argv=("true",), env={})
    try:
        with pytest.raises(RemoteSpawnError, match="answered the start of worker 1"):
            await remote.launch(request)
        answers["spawn"] = msgspec.json.encode(SpawnReply(pid=4242))
        proc = await remote.launch(request)
        # Every poll of n1 now gets an answer that is not a StatusReply.
        assert await asyncio.wait_for(proc.wait(), 10) == LOST and proc.lost
        assert remote._poller is not None and not remote._poller.done(), "the poller died"
    finally:
        await remote.close()
        await sub.unsubscribe()

"""Spare sidecars: the node daemon keeps sidecars started ahead of need, hands a
placed job to one of them on its stdin, and replaces, reaps and stops them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.clock import ScaledClock
from shoal.gpus import fake_gpus
from shoal_services.node_daemon.service import NodeDaemon
from shoal_services.trainer_sidecar import SPARE_JOB, adoption_line
from shoal_services.trainer_sidecar.__main__ import adopt_job

from tests.services.test_allocator_placer import wait_until
from tests.services.test_node_daemon import _alive, one_node_cluster, sidecar_argv

pytestmark = pytest.mark.integration


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_adoption_line_names_the_job_or_is_refused() -> None:
    assert await adopt_job(reader_of(b"\n" + adoption_line("job-7"))) == "job-7"
    assert await adopt_job(reader_of(b"")) is None  # the daemon never needed this spare
    for bad in (b"job-7\n", b'{"job": "x"}\n', b'{"job_id": ""}\n', b'{"job_id": "-"}\n', b'{"job_id": 3}\n'):
        with pytest.raises(ValueError, match="spare sidecar"):
            await adopt_job(reader_of(bad))


async def run_spare(bus: Bus, nats_url: str, stdin: bytes) -> tuple[int, bytes]:
    argv = sidecar_argv(bus, nats_url, "n0", ScaledClock(1.0))(SPARE_JOB)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, err


async def test_a_spare_that_is_never_used_exits_cleanly_and_a_bad_adoption_is_an_error(
    bus: Bus, nats_url: str
) -> None:
    code, err = await run_spare(bus, nats_url, b"")
    assert code == 0, err.decode()
    code, err = await run_spare(bus, nats_url, b"not json\n")
    assert code == 2
    assert b"spare sidecar" in err


async def test_placed_jobs_take_ready_spares_which_are_replaced_and_stopped(bus: Bus, nats_url: str) -> None:
    clock = ScaledClock(100.0)
    stop = asyncio.Event()
    daemon, services = one_node_cluster(bus, nats_url, clock, spares=2)
    daemon.refill_after_s = 0.3
    tasks = [asyncio.create_task(s.run(stop)) for s in services]
    seen: set[int] = set()
    try:
        await wait_until(lambda: daemon.spares_ready() == 2, timeout=60)
        spares = {p.pid for p in daemon._spares}
        seen |= spares
        # Three 1-GPU jobs of 100 iterations at 1 it/s: 100 virtual s = 1 wall s each.
        for j in ("a", "b", "c"):
            spec = ev.JobSpec(user="u", min_gpus=1, max_gpus=1, requested_gpus=1, total_iterations=100)
            await bus.publish(codec.wrap(ev.JobSubmitted(job_id=j, spec=spec), at=clock.now()))
        await wait_until(lambda: len(daemon.sidecars) == 3, timeout=30)
        pids = {j: s.proc.pid for j, s in daemon.sidecars.items()}
        seen |= set(pids.values())
        # Two jobs went to the two ready spares; the third had to start cold.
        assert len(spares & set(pids.values())) == 2, (spares, pids)
        state = daemon.projection.state
        await wait_until(lambda: all(state.jobs[j].status == "completed" for j in "abc"), timeout=60)
        # Once no job has been placed for a while, the spares are topped up again ...
        await wait_until(lambda: daemon.spares_ready() == 2, timeout=60)
        fresh = {p.pid for p in daemon._spares}
        assert not fresh & set(pids.values())
        seen |= fresh
        # ... and a spare that dies is replaced at the next heartbeat.
        victim = next(iter(fresh))
        os.kill(victim, signal.SIGKILL)
        await wait_until(
            lambda: daemon.spares_ready() == 2 and victim not in {p.pid for p in daemon._spares}, timeout=60
        )
        seen |= {p.pid for p in daemon._spares}
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    # Nothing the daemon started outlives it: job sidecars and spares alike.
    assert not [pid for pid in seen if _alive(pid)]


def test_spares_must_not_be_negative(bus: Bus) -> None:
    with pytest.raises(ValueError, match="spares"):
        NodeDaemon(
            bus,
            "n0",
            fake_gpus(1),
            clock=ScaledClock(1.0),
            sidecar_argv=lambda j: [sys.executable],
            spares=-1,
        )

"""node-daemon + emulated sidecars + allocator + placer: jobs run to completion on fake GPUs."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import BEATS_PER_NODE, Bus
from shoal.clock import ScaledClock
from shoal.gpus import fake_gpus
from shoal_services.allocator.service import AllocatorService
from shoal_services.node_daemon.service import NodeDaemon
from shoal_services.placer.service import PlacerService

from tests.services.test_allocator_placer import GreedyRequested, events_of, wait_until

pytestmark = pytest.mark.integration

SCALE = 100.0


def sidecar_argv(bus: Bus, nats_url: str, node_id: str, clock: ScaledClock):
    def argv(job_id: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "shoal_services.trainer_sidecar",
            "--job",
            job_id,
            "--node",
            node_id,
            "--nats-url",
            nats_url,
            "--prefix",
            bus.names.prefix,
            "--time-scale",
            str(clock.scale),
            "--clock-origin",
            str(clock.origin),
            "--costs",
            "coddl",
            "--catalog",
            "",
            "--report-every",
            "0.1",
        ]

    return argv


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def one_node_cluster(
    bus: Bus, nats_url: str, clock: ScaledClock, **daemon_kw: Any
) -> tuple[NodeDaemon, list[AllocatorService | PlacerService | NodeDaemon]]:
    """A 4-GPU node daemon ``n0`` under an allocator (GreedyRequested) and a placer."""
    daemon = NodeDaemon(
        bus,
        "n0",
        fake_gpus(4),
        clock=clock,
        sidecar_argv=sidecar_argv(bus, nats_url, "n0", clock),
        heartbeat_s=0.2,
        **daemon_kw,
    )
    allocator = AllocatorService(bus, GreedyRequested(), holder="a", clock=clock, node_timeout_s=None)
    return daemon, [allocator, PlacerService(bus, holder="p", clock=clock), daemon]


async def test_jobs_run_to_completion_on_emulated_gpus(bus: Bus, nats_url: str) -> None:
    clock = ScaledClock(SCALE)
    stop = asyncio.Event()
    daemon, services = one_node_cluster(bus, nats_url, clock)
    tasks = [asyncio.create_task(s.run(stop)) for s in services]
    try:
        await wait_until(lambda: "n0" in daemon.projection.state.nodes)
        # 2 GPUs each, linear curve: 2 it/s -> 100 iterations take 50 virtual s = 0.5 wall s.
        # The curve is known (a profile), so no job is capped at AFS §4.5's fair share.
        linear = {"": {k: float(k) for k in range(1, 5)}}
        for j in ("a", "b", "c"):
            spec = ev.JobSpec(
                user="u", min_gpus=1, max_gpus=4, requested_gpus=2, total_iterations=100, profile=linear
            )
            await bus.publish(codec.wrap(ev.JobSubmitted(job_id=j, spec=spec), at=clock.now()))
        state = daemon.projection.state

        def all_completed() -> bool:
            # A job the daemon's projection has not read yet is not completed (the publish
            # returns once the log has it, before the projection applies it).
            return all(job is not None and job.status == "completed" for job in map(state.jobs.get, "abc"))

        await wait_until(all_completed, timeout=30)
        pids = [s.proc.pid for s in daemon.sidecars.values()]
        await wait_until(lambda: not daemon.sidecars, timeout=10)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
    for pid in pids:
        assert not _alive(pid)
    completed = {e.job_id for e in await events_of(bus, ev.JobCompleted)}
    assert completed == {"a", "b", "c"}
    assert len(await events_of(bus, ev.JobCompleted)) == 3, "each job completes exactly once"
    starts = await events_of(bus, ev.ReconfigurationStarted)
    assert {s.job_id for s in starts if s.kind == "start"} == {"a", "b", "c"}
    done = await events_of(bus, ev.ReconfigurationCompleted)
    assert {d.job_id for d in done} >= {"a", "b", "c"}
    # c waited for a or b: its JCT is about twice theirs (virtual seconds).
    jct = {j: state.jobs[j].finished_at - state.jobs[j].submitted_at for j in "abc"}
    assert 40 <= jct["a"] <= 80 and 40 <= jct["b"] <= 80
    assert jct["c"] >= 90
    assert await events_of(bus, ev.NodeHeartbeat) == [], "heartbeats stay out of the log"
    beats = await bus.js.stream_info(bus.names.beats_stream)
    assert beats.state.messages <= BEATS_PER_NODE, (
        "the beats stream keeps at most eight of the node's heartbeats"
    )


async def test_an_idle_node_appends_nothing_to_the_log(bus: Bus, nats_url: str) -> None:
    """Issue 21 (bounded log growth): an idle node daemon's heartbeats go to the beats
    stream (at most eight kept), and a GPU's health reaches the log only when it changes."""
    clock = ScaledClock(SCALE)
    stop = asyncio.Event()
    daemon = NodeDaemon(
        bus,
        "n0",
        fake_gpus(4),
        clock=clock,
        sidecar_argv=sidecar_argv(bus, nats_url, "n0", clock),
        heartbeat_s=0.02,
        health_every=1,
        spares=0,
    )
    task = asyncio.create_task(daemon.run(stop))
    try:
        # Wait for 50 heartbeats (50 health checks, health_every=1).
        async def newest_beat() -> int:
            try:
                msg = await bus.js.get_last_msg(bus.names.beats_stream, bus.names.beat("n0"))
            except Exception:
                return 0
            event = codec.decode(msg.data or b"").event
            assert isinstance(event, ev.NodeHeartbeat)
            return event.seq

        deadline = asyncio.get_running_loop().time() + 30
        while await newest_beat() < 50:
            assert asyncio.get_running_loop().time() < deadline, "50 heartbeats were not stored"
            await asyncio.sleep(0.05)
        assert daemon.projection.state.nodes["n0"].status == "up"
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert await events_of(bus, ev.NodeHeartbeat) == []
    health = await events_of(bus, ev.GpuHealth)
    assert sorted(h.index for h in health) == [0, 1, 2, 3], "one reading per GPU: nothing changed after"
    info = await bus.js.stream_info(bus.names.beats_stream)
    assert info.state.messages <= BEATS_PER_NODE


def test_a_lightly_used_gpu_is_not_reported_idle() -> None:
    """A GPU a job keeps 8 % busy makes a new GpuHealth after an idle reading (on an H100,
    plain quarter steps left ``shoal nodes`` at 0 %); small changes within a step do not."""
    from shoal_services.node_daemon.service import utilisation_step

    assert utilisation_step(0.08) != utilisation_step(0.0)
    assert utilisation_step(0.01) == utilisation_step(0.08) == utilisation_step(0.12)
    assert utilisation_step(0.2) == utilisation_step(0.3) == 0.25
    assert utilisation_step(0.13) != utilisation_step(0.08)
    assert utilisation_step(1.0) == 1.0 and utilisation_step(0.0) == 0.0

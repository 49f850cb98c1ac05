"""NVML readings (faked here: CI has no GPU) reach the log as GpuHealth and the fold."""

from __future__ import annotations

import asyncio

import pytest
from shoal import events as ev
from shoal.bus import Bus
from shoal.clock import ScaledClock
from shoal.gpus import fake_gpus
from shoal_services.node_daemon import service as nd

from tests.services.test_allocator_placer import events_of, wait_until
from tests.services.test_node_daemon import sidecar_argv

pytestmark = pytest.mark.integration


async def test_a_gpu_a_job_keeps_lightly_busy_shows_its_utilisation(
    bus: Bus, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    readings = {"now": (0.0, 480, 39.0)}
    monkeypatch.setattr(nd, "read_nvml", lambda index: readings["now"])
    clock = ScaledClock(1.0)
    stop = asyncio.Event()
    daemon = nd.NodeDaemon(
        bus,
        "n0",
        fake_gpus(1, "H100"),
        clock=clock,
        sidecar_argv=sidecar_argv(bus, nats_url, "n0", clock),
        heartbeat_s=0.05,
        health_every=1,
        spares=0,
        emulated=False,
    )
    task = asyncio.create_task(daemon.run(stop))

    def folded() -> tuple[float, int] | None:
        node = daemon.projection.state.nodes.get("n0")
        return (node.gpus[0].utilization, node.gpus[0].memory_used_mb) if node else None

    try:
        await wait_until(lambda: folded() == (0.0, 480))  # the idle reading is in the log
        readings["now"] = (0.09, 1388, 41.0)  # a job keeps it 9 % busy (an H100 running the CNN)
        await wait_until(lambda: folded() == (0.09, 1388))
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    health = await events_of(bus, ev.GpuHealth)
    assert [h.utilization for h in health] == [0.0, 0.09]

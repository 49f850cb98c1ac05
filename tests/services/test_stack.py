"""The emulated stack end to end: a small workload is submitted through admission,
scheduled, placed and run by emulated sidecars, and summarised from the log."""

from __future__ import annotations

import pytest
from shoal import events as ev
from shoal.bus import Bus
from shoal.workloads import TraceJob
from shoal_services.stack import EmulatedStack, StackConfig, replay_trace, summarize

from tests.services.test_allocator_placer import GreedyRequested

pytestmark = pytest.mark.integration


def trace(n: int) -> list[TraceJob]:
    jobs = []
    for i in range(n):
        spec = ev.JobSpec(user="u", model="", min_gpus=1, max_gpus=4, requested_gpus=2, total_iterations=200)
        # linear curve: 2 GPUs -> 2 it/s -> 100 virtual s alone
        jobs.append(
            TraceJob(
                job_id=f"t{i}",
                spec=spec,
                submit_time_s=float(10 * i),
                duration_s=100.0,
                throughput=tuple(float(k) for k in range(5)),
            )
        )
    return jobs


async def test_stack_runs_a_small_trace(bus: Bus, nats_url: str) -> None:
    stack = EmulatedStack(
        bus,
        nats_url,
        GreedyRequested(),
        StackConfig(nodes=2, gpus_per_node=2, time_scale=200.0, catalog="", heartbeat_s=0.5),
    )
    await stack.start()
    try:
        jobs = trace(6)
        ticks: list[float] = []
        await replay_trace(stack, jobs, on_tick=lambda s, t: ticks.append(t), tick_s=0.1)
        result = summarize(stack.projection.state, [j.job_id for j in jobs], total_gpus=4)
    finally:
        await stack.stop()
    assert result["completed"] == 6
    # Alone each job takes 100 s; two run at a time, so later ones wait: the average JCT is well above 100 s.
    assert 100 <= result["avg_jct_s"] <= 400
    assert 0.3 <= result["gpu_utilisation"] <= 1.0
    assert ticks

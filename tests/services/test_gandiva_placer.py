"""The allocator and placer services carry out Gandiva_fair's node choice (issue 23):
the placer places each gang on the servers the policy named in its decision, through
the same :func:`shoal.allocation.place` the simulator calls."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shoal import events as ev
from shoal.bus import Bus
from shoal.clock import WallClock
from shoal.fairness.policy import GandivaFairPolicy
from shoal.placement import NodeSlots, Topology
from shoal.placement.hinted import NODE_HINTS, resolve_hint
from shoal_services.allocator.service import AllocatorService
from shoal_services.placer.service import PlacerService

pytestmark = pytest.mark.integration


async def wait_until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_the_placer_puts_each_gang_on_the_servers_gandiva_fair_named(bus: Bus) -> None:
    stop = asyncio.Event()
    alloc = AllocatorService(bus, GandivaFairPolicy(), holder="a1", clock=WallClock(), node_timeout_s=None)
    placer = PlacerService(bus, holder="p1", clock=WallClock())
    tasks = [asyncio.create_task(alloc.run(stop)), asyncio.create_task(placer.run(stop))]
    nodes = [
        ev.NodeRegistered(node_id=n, gpus=tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(4)))
        for n in ("n0", "n1")
    ]
    sizes = {"a": 1, "b": 1, "c": 1, "d": 1}  # Gandiva_fair spreads them; min-migration would pack
    try:
        await bus.publish_many(nodes)
        for j, s in sizes.items():
            spec = ev.JobSpec(user=f"u-{j}", min_gpus=s, max_gpus=s, requested_gpus=s, elastic=False)
            await bus.publish(ev.JobSubmitted(job_id=j, spec=spec))
        await wait_until(lambda: len(placer.projection.state.placed) == len(sizes))
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
    log = [e.event async for _, e in bus.replay()]
    shares = {e.epoch: e for e in log if isinstance(e, ev.SharesDecided)}
    placed = [e for e in log if isinstance(e, ev.PlacementDecided)]
    topology = Topology(
        nodes=tuple(NodeSlots(node_id=n.node_id, gpu_indices=(0, 1, 2, 3), gpu_type="V100") for n in nodes)
    )
    assert placed
    for p in placed:
        hints = shares[p.epoch].policy_memory[NODE_HINTS]
        for job, gpus in p.placements.items():
            chosen = resolve_hint(topology, hints[job])
            assert chosen is not None and {g.node_id for g in gpus} <= {n.node_id for n in chosen}
            assert len(gpus) == sizes[job]
    # Least ticket load (§3.2) spreads the four 1-GPU jobs over both servers.
    assert {g.node_id for gpus in placed[-1].placements.values() for g in gpus} == {"n0", "n1"}

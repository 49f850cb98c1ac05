"""A heterogeneous emulated cluster through `shoal up --gpu-type V100,K80`: the nodes
take the generations in turn, and an emulated job runs at its curve for the generation
it is placed on (as the simulator runs it), so speedups between generations, which
Gandiva_fair's profiling and trading read, exist in emulation too."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.client import Client

from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration

RATES = {"V100": 10.0, "K80": 2.0}


async def test_an_emulated_job_runs_at_the_speed_of_the_generation_it_is_placed_on(tmp_path: Path) -> None:
    async with (
        shoal_up(tmp_path, nodes=2, flags=("--gpu-type", "V100,K80")) as up,
        await Client.connect(up.url, "shoal", **up.admin()) as client,
    ):
        deadline = time.monotonic() + 30
        while len(nodes := await client.nodes()) < 2:
            assert time.monotonic() < deadline, "node daemons did not register"
            await asyncio.sleep(0.2)
        assert {n: {g.gpu_type for g in node.gpus} for n, node in nodes.items()} == {
            "node0": {"V100"},
            "node1": {"K80"},
        }
        # Two rigid 2-GPU jobs: each fills one node, whichever generation it is.
        profile = {t: {1: r, 2: 2 * r} for t, r in RATES.items()}
        spec = ev.JobSpec(
                user="alice", min_gpus=2, max_gpus=2, requested_gpus=2, elastic=False,
                total_iterations=10**7, profile=profile,
            )  # fmt: skip
        jobs = ("j-a", "j-b")
        for job_id in jobs:
            await client.submit(spec, job_id=job_id)
        rates: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while len(rates) < 2:
            assert time.monotonic() < deadline, f"no progress on both nodes: {rates}"
            for job_id in jobs:
                node = ""
                async for env in client.job_events(job_id, follow=False):
                    if isinstance(env.event, ev.ReconfigurationCompleted) and env.event.gpus:
                        node = env.event.gpus[0].node_id
                    elif isinstance(env.event, ev.ProgressReported) and env.event.num_gpus == 2 and node:
                        rates[node] = env.event.samples_per_s
            await asyncio.sleep(0.5)
        assert rates == {"node0": 2 * RATES["V100"], "node1": 2 * RATES["K80"]}

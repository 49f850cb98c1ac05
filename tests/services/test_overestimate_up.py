"""CoDDL §4.5 overestimate-first, live: ``shoal up`` with emulated nodes takes a new
job through its smaller allocatable units as the profiler's measurements arrive.

No catalog, no profile: the allocator knows nothing of the job's throughput, so it
assumes linear scaling and gives it its fair share (here the whole 4-GPU cluster, the
only job). The profiler measures the emulated trainer at 4 GPUs; the allocator, on
that model update, shrinks the job to the next unmeasured allocatable unit (2), then
to 1, each once the profiler has published the count before, and then re-adjusts on
the measured curve (linear here, so back to 4). The same functions decide in the
simulator (``tests/sim/test_profiling.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.errors
import pytest
from shoal import events as ev
from shoal.client import Client, NoAdmissionError

from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration


@pytest.mark.slow  # about 35 s on two busy cores, most of it shoal up starting
async def test_a_new_job_is_measured_at_its_smaller_units_then_readjusted(tmp_path: Path) -> None:
    # 10 virtual seconds between two models of a job: half a wall second at 20x.
    async with shoal_up(tmp_path, policy="afs-p", SHOAL_PROFILER_MIN_INTERVAL_S="10") as up:
        spec = ev.JobSpec(user="alice", min_gpus=1, max_gpus=4, requested_gpus=4, total_iterations=10**6)
        seen: list[ev.Event] = []
        async with await Client.connect(up.url, "shoal", **up.admin()) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    await client.submit(spec, job_id="probe")
                    break
                except NoAdmissionError as exc:
                    if not isinstance(exc.__cause__, nats.errors.NoRespondersError):
                        raise
                    assert time.monotonic() < deadline, "admission never answered"
                    await asyncio.sleep(0.2)

            async def follow() -> None:
                # Until the fourth change of the job's share (the re-adjustment); the job
                # itself is long and is stopped with the installation.
                async for env in client.job_events("probe", include_shares=True):
                    seen.append(env.event)
                    if sum(isinstance(e, ev.SharesDecided) for e in seen) == 4:
                        return

            await asyncio.wait_for(follow(), 90)
    decisions = [(e.shares.get("probe", 0), e.trigger) for e in seen if isinstance(e, ev.SharesDecided)]
    models = [e for e in seen if isinstance(e, ev.ThroughputModelUpdated)]
    # One model per newly measured count, the share first, then the smaller units.
    assert [m.measured for m in models[:3]] == [(4,), (2, 4), (1, 2, 4)]
    # On the estimate while counts are missing; three measured counts make the profiler
    # trust its Optimus fit (fit_min_counts), which ends the estimate.
    assert [m.model_kind for m in models[:2]] == ["afs-overestimate"] * 2
    # The allocator's decisions for the job: its share, the two probes, the re-adjustment.
    shares = [s for s, _ in decisions]
    assert shares[:4] == [4, 2, 1, 4]
    assert [t for _, t in decisions[1:4]] == ["model_update"] * 3

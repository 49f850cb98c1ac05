"""Issue 20: an emulated job with a ``convergence_target`` finishes. Through ``shoal up``
with emulated nodes: the emulated trainer reports a loss (Optimus eq. (1), reaching the
target after ``SHOAL_TRAIN_EMULATED_ITERATIONS``), the profiler fits it and publishes
``ConvergenceEstimated``, and the job completes when the loss reaches its target."""

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


# In the default run (issue 20: the input cases run there): about 30 s on two busy cores,
# most of it shoal up starting.
async def test_an_emulated_job_with_a_convergence_target_completes(tmp_path: Path) -> None:
    spec = ev.JobSpec(
        user="alice",
        min_gpus=2,
        max_gpus=2,
        requested_gpus=2,
        convergence_target=0.5,
        env={"SHOAL_TRAIN_EMULATED_ITERATIONS": "300"},
    )
    seen: list[ev.Event] = []
    # Reports at a fixed interval (no back-off), so that the profiler has its five loss
    # points before the loss reaches the target.
    settings = {"SHOAL_REPORT_MAX_EVERY_S": "0.25"}
    async with (
        shoal_up(tmp_path, **settings) as up,
        await Client.connect(up.url, "shoal", **up.admin()) as client,
    ):
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.submit(spec, job_id="conv")
                break
            except NoAdmissionError as exc:
                if not isinstance(exc.__cause__, nats.errors.NoRespondersError):
                    raise
                assert time.monotonic() < deadline, "admission never answered"
                await asyncio.sleep(0.2)

        async def follow() -> None:
            async for env in client.job_events("conv"):
                seen.append(env.event)

        await asyncio.wait_for(follow(), 120)
    assert isinstance(seen[-1], ev.JobCompleted) and seen[-1].iterations == 300
    losses = [e.loss for e in seen if isinstance(e, ev.ProgressReported) and e.loss is not None]
    assert len(losses) >= 5 and losses == sorted(losses, reverse=True)
    assert losses[-1] == pytest.approx(0.5, rel=0.05)
    estimates = [e for e in seen if isinstance(e, ev.ConvergenceEstimated)]
    assert estimates and estimates[-1].estimated_total_iterations == pytest.approx(300, rel=0.05)

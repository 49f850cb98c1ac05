"""Bounded restarts (TorchElastic's ``--max-restarts``, ``SHOAL_TRAIN_MAX_RESTARTS``): a
job that cannot keep its workers fails instead of restarting for ever or waiting for
ever with none. Real worker processes under a real :class:`~shoal.train.controller.Controller`."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from shoal import events as ev
from shoal.train.config import TrainConfig

from tests.train.conftest import Recorder, order, processes_of, wait_steps


@pytest.mark.integration
async def test_a_job_whose_workers_cannot_start_fails_after_its_restarts(
    make_controller, job_id: str
) -> None:
    """A start whose workers exit at once fails; it is retried ``max_restarts`` times,
    then the job fails (before: one ``ReconfigurationFailed`` and the job waited for
    ever with no worker, holding its GPUs)."""
    rec = Recorder()
    ctl = make_controller(
        argv=[sys.executable, "-c", "import sys; sys.exit(3)"],
        emit=rec,
        train=TrainConfig(collective_timeout_s=10, rendezvous_timeout_s=20, max_restarts=2),
    )
    await ctl.start()
    await ctl.apply(order(job_id, 1, 1))
    await rec.wait_for(lambda: ctl.failed is not None, 60)
    assert [s.kind for s in rec.of(ev.ReconfigurationStarted)] == ["start"] * 3
    assert len(rec.of(ev.ReconfigurationFailed)) == 3
    assert ctl.failed is not None and "SHOAL_TRAIN_MAX_RESTARTS=2" in ctl.failed
    assert ctl.current is None and ctl.inflight is None


@pytest.mark.slow
@pytest.mark.integration
async def test_a_job_that_keeps_losing_a_worker_fails_after_its_restarts(
    make_controller, job_id: str
) -> None:
    """kill -9 of a worker: restarted from the checkpoint while restarts are left; the next
    death ends the job (``failed`` set, no worker left) instead of restarting for ever."""
    rec = Recorder()
    ctl = make_controller(
        emit=rec,
        train=TrainConfig(
            collective_timeout_s=10, rendezvous_timeout_s=60, checkpoint_every=20, max_restarts=1
        ),
    )
    await ctl.start()
    await ctl.apply(order(job_id, 1, 2))
    await ctl.wait_idle(120)
    await wait_steps(ctl, 25)
    for _ in range(2):
        assert ctl.current is not None
        done = len(rec.of(ev.ReconfigurationCompleted))
        os.kill(ctl.workers[ctl.current.members[-1]].proc.pid, signal.SIGKILL)
        await rec.wait_for(
            lambda: ctl.failed is not None or len(rec.of(ev.ReconfigurationCompleted)) > done,  # noqa: B023
            120,
        )
        if ctl.failed is None:
            await ctl.wait_idle(120)
            await wait_steps(ctl, 5)
    assert ctl.failed is not None and "no restart left" in ctl.failed
    assert [s.kind for s in rec.of(ev.ReconfigurationStarted)] == ["start", "recover"]
    assert ctl.current is None
    deadline = asyncio.get_running_loop().time() + 10
    while processes_of(job_id) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    assert not processes_of(job_id)

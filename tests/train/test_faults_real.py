"""The fault suite's real-mode faults (issue 21, :data:`shoal.faults.REAL`): ``shoal up``
started as a user starts it, in real mode (``SHOAL_SIDECAR_MODE=real``, the entrypoint
allowlist naming ``examples/cnn_digits.py``), two nodes of one GPU, real jobs on CPU with
gloo submitted through the SDK; kill -9 of a job's leading sidecar, and of one of its
training workers. Each is ``slow`` (a minute or two on two loaded cores: torch imports).

The default run has only the cheap check that the orphan check sees a training worker
outside the installation's sessions (no installation needed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from shoal.faults import REAL, REAL_KW, FaultSuite, Result, run_suite, train_job_of


def _failures(results: list[Result]) -> list[str]:
    return [f"{r.fault}: {r.failed} ({'; '.join(r.notes)})" for r in results if r.failed]


async def _one(tmp_path: Path, target: str) -> Result:
    fault = next(f for f in REAL if f.target == target)
    results = await run_suite(tmp_path, (fault,), **REAL_KW)
    assert [r.fault for r in results] == [fault.name, "(end of run)"]
    assert _failures(results) == []
    return results[0]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
async def test_kill_of_a_sidecar_leader_in_real_mode(tmp_path: Path) -> None:
    """The job's other sidecar takes the lease and restarts it from the checkpoint; the
    node daemon restarts the killed sidecar; every job ends, no worker is left over."""
    r = await _one(tmp_path, "sidecar-leader-real")
    assert r.to_training_s is not None and r.to_decision_s is not None and r.to_placement_s is not None
    assert any("leader" in n for n in r.notes) and any("killed" in n for n in r.notes)
    assert any("restored the checkpoint of step" in n for n in r.notes), r.notes


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
async def test_kill_of_a_training_worker_in_real_mode(tmp_path: Path) -> None:
    """The leader notices the worker's death, restarts the job from the checkpoint
    (consistent recovery) on the GPU left, gives the killed worker's GPU back, and the job
    completes; no worker is left over."""
    r = await _one(tmp_path, "worker-real")
    assert r.to_training_s is not None
    assert any(n.startswith("recover ") and "restored the checkpoint of step" in n for n in r.notes), r.notes
    # ... and the killed worker's GPU is given back: the job runs on both GPUs again.
    assert any(n.startswith("back to 2 GPUs") for n in r.notes), r.notes


async def test_the_orphan_check_sees_a_training_worker_outside_the_installation(tmp_path: Path) -> None:
    """A process whose ``SHOAL_TRAIN_JOB`` names a job of the run counts as an orphan
    wherever it runs (a worker that outlived its sidecar need not stay in its session)."""
    suite = FaultSuite(tmp_path, real=True)
    root = subprocess.Popen(["sleep", "60"])  # stands in for shoal up: nothing under it
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        env={**os.environ, "SHOAL_TRAIN_JOB": "load-00001"},
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    try:
        assert stray.stdout is not None and stray.stdout.readline() == b"up\n"  # started
        suite.proc = root  # type: ignore[assignment]
        suite._sessions = {root.pid}
        assert train_job_of(stray.pid) == "load-00001"
        assert await suite.check_orphans(1)  # not a job of this run
        suite.accepted["load-00001"] = 0.0
        assert not await suite.check_orphans(1)
        assert stray.pid in suite.leftovers()
        suite.real = False  # the emulated suite looks at its sessions only
        assert await suite.check_orphans(1)
    finally:
        for p in (root, stray):
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
async def test_a_worker_kill_with_no_restart_left_fails_the_job_through_shoal_up(tmp_path: Path) -> None:
    """Jobs allowed no restart (``SHOAL_TRAIN_MAX_RESTARTS=0`` in ``spec.env``): the kill
    of a worker ends its job ``failed`` with the reason (published by the leading
    sidecar), its workers stop, its GPUs go to the next job, and every check holds."""
    fault = next(f for f in REAL if f.target == "worker-real")
    kw = {**REAL_KW, "real_job_env": {"SHOAL_TRAIN_MAX_RESTARTS": "0"}}
    results = await run_suite(tmp_path, (fault,), **kw)
    assert _failures(results) == []
    r = results[0]
    assert r.to_training_s is None
    ended = [n for n in r.notes if " ended " in n]
    assert len(ended) == 1 and "ended failed" in ended[0] and "no restart left" in ended[0], r.notes

"""The fault suite under load (issue 21, :mod:`shoal.faults`) against ``shoal up`` started
as a user starts it, with a standby ``shoal run allocator`` and a steady load of
submissions through the SDK. The default run injects the reduced set (kill -9 of
admission, the allocator leader, the placer, a node daemon and the NATS server; SIGSTOP
of the allocator leader past the lease TTL); the whole suite is ``slow``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.client import Client
from shoal.faults import FULL, REDUCED, FaultSuite, Result, pauses, run_suite

pytestmark = pytest.mark.integration


def _failures(results: list[Result]) -> list[str]:
    return [f"{r.fault}: {r.failed} ({'; '.join(r.notes)})" for r in results if r.failed]


async def test_reduced_fault_suite(tmp_path: Path) -> None:
    results = await run_suite(tmp_path, REDUCED)
    assert [r.fault for r in results] == [f.name for f in REDUCED] + ["(end of run)"]
    assert _failures(results) == []
    for r in results[:-1]:
        assert r.to_decision_s is not None and r.to_placement_s is not None


@pytest.mark.slow
async def test_full_fault_suite(tmp_path: Path) -> None:
    results = await run_suite(tmp_path, FULL)
    assert _failures(results) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_a_sixty_second_pause_of_any_process_is_survived(tmp_path: Path) -> None:
    """Issue 21: after a 60 s SIGSTOP of any process (each service, the standby, a node
    daemon, a sidecar, the NATS server), scheduling resumes and every check passes,
    without anyone restarting ``shoal up``."""
    results = await run_suite(tmp_path, pauses(60.0), recovery_timeout_s=120.0, submit_every_s=5.0)
    assert _failures(results) == []
    for r in results[:-1]:
        assert r.to_decision_s is not None and r.to_placement_s is not None


async def test_every_check_can_fail(tmp_path: Path) -> None:
    """Each check of the suite, against a real installation put in the state it must catch
    (the leader check caught a real race: see Campaign.is_leader)."""
    async with FaultSuite(tmp_path, recovery_timeout_s=3.0) as suite:
        suite.start_load()
        assert await _until(lambda: len(suite.accepted) >= 2, 30)
        assert await suite.check_once() and await suite.check_epochs() and await suite.check_digests()
        assert await suite.check_orphans(1) and await suite.check_ready() and await suite.check_one_leader()
        bus, follower = suite.bus, suite.follower
        assert bus is not None and follower is not None
        # ready: a paused service does not answer /readyz.
        placer = suite.pid_of("placer")
        assert placer is not None
        os.kill(placer, signal.SIGSTOP)
        try:
            assert not await suite.check_ready()
        finally:
            os.kill(placer, signal.SIGCONT)
        # digest: the harness folds differently from the services (a fold that drops an event).
        real_apply = st.apply
        skip = {"alloc.shares_decided"}
        st.apply = lambda s, env: s if env.type in skip else real_apply(s, env)  # type: ignore[assignment]
        try:
            assert not await suite.check_digests()
        finally:
            st.apply = real_apply
        # orphans: a process of the installation's session that is nobody's child.
        stray = subprocess.Popen(["sleep", "60"], start_new_session=True)
        suite._sessions.add(stray.pid)
        try:
            assert not await suite.check_orphans(1)
        finally:
            stray.kill()
            stray.wait()
        # terminal: a job far too long to end.
        await suite.stop_load()
        job = "never"
        spec = ev.JobSpec(user="alice", min_gpus=1, max_gpus=1, requested_gpus=1, total_iterations=10**12)
        async with await Client.connect(suite.url, "shoal", creds=str(suite.creds / "admin.nk")) as c:
            await c.submit(spec, job_id=job)
        suite.accepted[job] = 0.0
        assert not await suite.check_terminal([job], 3)
        # once: the same submission twice in the log (forged by the admin).
        first = next(iter(suite.accepted))
        await bus.publish(codec.wrap(ev.JobSubmitted(job_id=first, spec=spec)))
        assert not await suite.check_once()
        # epochs: a decision with an old epoch.
        await bus.publish(codec.wrap(ev.SharesDecided(epoch=1, shares={})))
        assert not await suite.check_epochs()


async def _until(pred: Callable[[], bool], timeout_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True

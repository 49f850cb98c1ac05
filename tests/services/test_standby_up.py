"""Standbys of the leader-elected services through the shipped commands (the Kubernetes
manifests run two allocators and two placers): a second `shoal run <service>` started
with the environment of `shoal up`'s waits as standby, takes the lease when the leader
stops answering past its TTL (SIGSTOP), does the service's work (the placer places the
next job), and the old leader, continued, comes back as standby, never as a second
leader. The allocator's standby is the fault suite's (tests/services/test_fault_suite.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from shoal.commands.run import CLI_ARGV as CLI
from shoal.faults import _free_port, _metric, _scrape

from tests.services.test_liveness import run_job, shoal_up

pytestmark = pytest.mark.integration


def _leader(probe: str) -> float | None:
    status, text = _scrape(probe + "/metrics")
    if status != 200:
        return None
    values = [v for _, v in _metric(text, "shoal_leader")]
    return values[0] if values else None


async def _until(what: str, timeout_s: float, check: object) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("service", ["placer", "profiler", "trader"])
async def test_a_standby_takes_over_and_the_old_leader_comes_back_as_standby(
    tmp_path: Path, service: str
) -> None:
    async with shoal_up(tmp_path, nodes=1) as up:
        first = up.pid_of("run", service)
        raw = Path(f"/proc/{first}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        first_probe = f"http://127.0.0.1:{env['SHOAL_METRICS_PORT']}"
        port = _free_port()
        env["SHOAL_METRICS_PORT"] = str(port)
        probe = f"http://127.0.0.1:{port}"
        err = (tmp_path / "standby.err").open("w")
        standby = subprocess.Popen([*CLI, "run", service], env=env, stderr=err, start_new_session=True)
        try:
            await _until(
                "the second placer is a ready standby", 60, lambda: _scrape(probe + "/readyz")[0] == 200
            )
            assert _leader(probe) == 0.0 and _leader(first_probe) == 1.0
            os.kill(first, signal.SIGSTOP)
            try:
                await _until("the standby takes the lease", 30, lambda: _leader(probe) == 1.0)
                if service == "placer":  # the job's placement can only come from the standby now
                    assert await run_job(up, "standby-placed", 2) == {"node0"}
            finally:
                os.kill(first, signal.SIGCONT)
            await _until("the old leader answers again", 30, lambda: _leader(first_probe) is not None)
            await asyncio.sleep(3.0)  # a lease TTL: it must not have taken the lease back
            assert (_leader(first_probe), _leader(probe)) == (0.0, 1.0)
            assert standby.poll() is None, (tmp_path / "standby.err").read_text()[-2000:]
        finally:
            standby.send_signal(signal.SIGTERM)
            try:
                assert standby.wait(30) == 0
            except subprocess.TimeoutExpired:
                standby.kill()
                raise

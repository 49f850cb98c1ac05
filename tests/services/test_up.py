"""`shoal up` end to end: real processes, a real embedded server, a job placed and
completed, then SIGTERM and a clean exit with no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.client import Client
from shoal.commands import _connect
from shoal.commands.run import CLI_ARGV as CLI
from shoal.faults import descendants
from shoal.runtime import resolve_nats_url
from shoal.settings import Settings

pytestmark = pytest.mark.integration


def usable_policy() -> str:
    """A policy whose module is in this build (the test is about processes, not policy)."""
    from shoal.policies.registry import PolicyImportError, policy_class

    for name in ("afs-p", "fifo", "tiresias-l", "srtf", "gandiva-fair"):
        try:
            policy_class(name)
        except PolicyImportError:
            continue
        return name
    pytest.fail("no allocation policy can be imported")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting with {prefix!r} from shoal up; got {seen}")


async def run_job(url: str, creds: str) -> str:
    async with await Client.connect(url, "shoal", creds=creds) as client:
        deadline = time.monotonic() + 30
        while len(await client.nodes()) < 2:
            assert time.monotonic() < deadline, "node daemons did not register"
            await asyncio.sleep(0.2)
        job_id = await client.submit(
            ev.JobSpec(user="alice", max_gpus=2, requested_gpus=2, total_iterations=40), job_id="up-job-1"
        )
        seen: list[str] = []
        placed_on: set[str] = set()

        async def follow() -> None:
            async for env in client.job_events(job_id):
                seen.append(env.type)
                if isinstance(env.event, ev.ReconfigurationCompleted):
                    placed_on.update(g.node_id for g in env.event.gpus)

        await asyncio.wait_for(follow(), 60)
        assert "alloc.placement_decided" not in seen  # job events only
        assert "reconf.completed" in seen, seen
        assert seen[-1] == "job.completed", seen
        job = await client.status(job_id)
        assert job.status == "completed"
        assert placed_on and placed_on <= {"node0", "node1"}, placed_on
        return job_id


def test_up_runs_a_job_and_stops_cleanly(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) drains every
    child once: each service logs a clean stop and `shoal up` exits 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
    proc = subprocess.Popen(
        [
            *CLI,
            "up",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--time-scale",
            "20",
            "--policy",
            usable_policy(),
        ],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.err").open("w"),
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        url = wait_line(proc, "NATS: ", 30).split(" ", 1)[1].strip()
        services = wait_line(proc, "services: ", 30).split(":", 1)[1].strip().split(", ")
        wait_line(proc, "running", 90)
        # A second `shoal up` on the same state dir is refused while this one runs.
        second = subprocess.run([*CLI, "up"], env=env, capture_output=True, text=True, timeout=30)
        assert second.returncode != 0
        assert "already running" in second.stderr
        # Services and clients started later find this server through the state dir.
        state_env = {"SHOAL_STATE_DIR": env["SHOAL_STATE_DIR"]}
        assert resolve_nats_url(Settings.load(state_env)) == url
        assert _connect.resolve_url(env=state_env) == url
        admin = tmp_path / "state" / "creds" / "admin.nk"
        assert _connect.resolve_creds(env=state_env) == str(admin)
        assert admin.stat().st_mode & 0o077 == 0, "credentials readable by others"
        asyncio.run(run_job(url, str(admin)))
        family = descendants(proc.pid)
        # the server, admission, allocator, placer, two node daemons, and the job's sidecar(s)
        assert len(family) >= 6, family
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        rest = proc.stdout.read() if proc.stdout else ""
        assert "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if alive(p)], "processes left behind by shoal up"
    assert not (tmp_path / "state" / "up.json").exists()
    err = (tmp_path / "up.err").read_text()
    assert "did not exit cleanly" not in err
    stops = [json.loads(line) for line in err.splitlines() if line.startswith("{") and '"stopped"' in line]
    clean = [e["service"] for e in stops if e.get("event") == "stopped" and e.get("clean")]
    supervised = [name for name in clean if name != "trainer-sidecar"]  # sidecars are the daemons' children
    assert len(supervised) == len(services), (services, clean)
    assert "trainer-sidecar" in clean  # the job's sidecar was stopped by its node daemon, cleanly
    assert not any("forced_exit" in line for line in err.splitlines())

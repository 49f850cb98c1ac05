"""Reads from admission's materialised view (shoal.queries) with real processes: a
``shoal run admission`` child on the session's nats-server and the ``shoal`` CLI as a
user runs it.

* ``shoal jobs --json`` (filtered too), ``status --json`` and ``nodes --json`` print the
  same through the view as with ``--replay`` on a small realistic log, and the view
  path did not replay (no note on stderr);
* read-your-writes: a job submitted right behind a burst of events is in the very next
  read, answered by the view (it waited for the submission's sequence);
* with no admission running, the reads fall back to a replay (and say so);
* an answer larger than the server's message limit arrives in parts, which the
  admission identity's permissions allow;
* a client identity of another user may query as itself, but may neither query as
  someone else nor subscribe to the queries (the server refuses both).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.audit import _Conn
from shoal.auth import Role
from shoal.bus import AuthFailed, Bus
from shoal.client import Client
from shoal.commands.run import CLI_ARGV
from shoal.nats_server import EmbeddedNats

from tests.conftest import add_identity
from tests.scripts import load_script

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def bench_services() -> ModuleType:
    path = ROOT / "benchmarks" / "bench_services.py"
    return load_script(path, "bench_services_for_query", register=True)


def small_history() -> list[ev.Envelope]:
    """About 3,000 events of a running cluster (nodes, 30 active jobs, completions,
    shares, placements, progress) plus a cancelled job of another user."""
    out = [env for chunk in bench_services().history_chunks(3000, jobs=30, nodes=4) for env in chunk]
    spec = ev.JobSpec(user="carol", max_gpus=2, requested_gpus=1, total_iterations=10)
    out.append(codec.wrap(ev.JobSubmitted(job_id="carol-1", spec=spec)))
    out.append(codec.wrap(ev.JobCancelled(job_id="carol-1", reason="changed my mind")))
    return out


def child_env(url: str, prefix: str, state_dir: Path) -> dict[str, str]:
    """A user's shell for this installation: its server, prefix and the admin's seed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    env.update(NATS_URL=url, SHOAL_PREFIX=prefix, SHOAL_STATE_DIR=str(state_dir), SHOAL_LOG_FORMAT="json")
    return env


def admitted(server: EmbeddedNats, role: Role, subject: str = "") -> str:
    """A new identity's seed file, once the server (reloaded in the background) admits it."""
    creds = add_identity(server, role, subject)

    async def probe() -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                bus = await Bus.connect(server.url, "probe", creds=creds, declare=False)
            except AuthFailed:
                assert time.monotonic() < deadline, f"the server never admitted {creds}"
                await asyncio.sleep(0.05)
                continue
            await bus.close()
            return

    asyncio.run(probe())
    return creds


@pytest.fixture
def admission(
    nats_server: EmbeddedNats, nats_url: str, prefix: str, tmp_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``shoal run admission`` for the test's prefix, as the admission identity (with its
    permissions, as ``shoal up`` runs it), logging to a file; stopped at the end."""
    env = child_env(nats_url, prefix, tmp_path / "state")
    env["NATS_CREDS"] = admitted(nats_server, "admission")
    with open(tmp_path / "admission.log", "wb") as out:
        proc = subprocess.Popen(
            [*CLI_ARGV, "run", "admission"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_for_view(url: str, prefix: str, creds: str, timeout_s: float = 30.0) -> None:
    """Until a read is answered by the view (admission started and subscribed)."""
    async with await Client.connect(url, prefix, creds=creds, timeout_s=2.0) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            await client.view("nodes")
            assert client.last_read is not None
            if client.last_read.source == "view":
                return
            assert time.monotonic() < deadline, f"no view answered: {client.last_read.reason}"
            await asyncio.sleep(0.1)


def shoal(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*CLI_ARGV, *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


async def test_cli_reads_through_the_view_match_a_replay(
    bus: Bus,
    nats_url: str,
    prefix: str,
    admin_creds: str,
    tmp_path: Path,
    admission: subprocess.Popen[bytes],
) -> None:
    await bus.publish_many(small_history())
    await wait_for_view(nats_url, prefix, admin_creds)
    env = child_env(nats_url, prefix, tmp_path / "state")
    job = "job-0000003"
    reads = [
        ("jobs", "--json"),
        ("jobs", "--json", "--active", "--user", "u1"),
        ("jobs", "--json", "--state", "completed", "--state", "cancelled"),
        ("jobs",),
        ("status", job, "--json"),
        ("status", "carol-1"),
        ("nodes", "--json"),
        ("nodes",),
    ]
    for args in reads:
        viewed = await asyncio.to_thread(shoal, env, *args)
        replayed = await asyncio.to_thread(shoal, env, *args, "--replay")
        assert "note: replayed" not in viewed.stderr, (args, viewed.stderr)
        assert viewed.stdout == replayed.stdout, args
    jobs = json.loads((await asyncio.to_thread(shoal, env, "jobs", "--json")).stdout)
    statuses = {row["status"] for row in jobs}
    assert len(jobs) > 30 and {"running", "completed", "cancelled"} <= statuses, statuses
    nodes = json.loads((await asyncio.to_thread(shoal, env, "nodes", "--json")).stdout)
    assert len(nodes) == 4 and any(row["jobs"] for row in nodes)


async def test_read_your_writes_after_a_submit(
    bus: Bus, nats_url: str, prefix: str, admin_creds: str, admission: subprocess.Popen[bytes]
) -> None:
    """A burst of 20,000 events, then a submission through admission and one written
    straight to the log: the next reads see both, from the view (which waited)."""
    await wait_for_view(nats_url, prefix, admin_creds)
    history = [env for chunk in bench_services().history_chunks(20_000, jobs=50, nodes=4) for env in chunk]
    async with await Client.connect(nats_url, prefix, creds=admin_creds) as client:
        await bus.publish_many(history)
        spec = ev.JobSpec(user="dave", max_gpus=1, requested_gpus=1, total_iterations=10)
        job_id = await client.submit(spec, job_id="rw-1")
        assert (await client.status(job_id)).status == "pending"
        assert client.last_read is not None and client.last_read.source == "view"
        await bus.publish_many(history[:5000])
        written = await bus.publish(ev.JobSubmitted(job_id="rw-2", spec=spec))
        assert (await client.status("rw-2")).spec.user == "dave"
        assert client.last_read.source == "view", client.last_read
        assert client.last_read.seq >= written.seq


async def test_reads_fall_back_to_a_replay_without_admission(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    await bus.publish_many(small_history())
    env = child_env(nats_url, prefix, tmp_path / "state")
    for args in [("jobs", "--json"), ("status", "carol-1", "--json"), ("nodes", "--json")]:
        fallback = await asyncio.to_thread(shoal, env, *args)
        assert "note: replayed the event log (no view answers" in fallback.stderr, fallback.stderr
        replayed = await asyncio.to_thread(shoal, env, *args, "--replay")
        assert fallback.stdout == replayed.stdout
    assert json.loads(fallback.stdout)[0]["node_id"] == "node0"


async def test_another_user_may_query_as_itself_but_not_listen_to_queries(
    nats_server: EmbeddedNats,
    bus: Bus,
    nats_url: str,
    prefix: str,
    admin_creds: str,
    admission: subprocess.Popen[bytes],
) -> None:
    """Everyone may read every job (the log is readable by every identity anyway); no
    one but admission (and the admin) may subscribe to the queries: it would see other
    users' requests, and could answer them."""
    await bus.publish_many(small_history())
    await wait_for_view(nats_url, prefix, admin_creds)
    mallory = await asyncio.to_thread(admitted, nats_server, "client", "mallory")
    async with await Client.connect(nats_url, prefix, creds=mallory) as client:
        jobs = await client.jobs()
        assert client.last_read is not None and client.last_read.source == "view"
        assert "carol-1" in jobs

    listener = await _Conn.open(nats_url, mallory)
    try:
        sub = await listener.nc.subscribe(f"{prefix}.query.>")
        why = await listener.violation()
        assert why is not None and "subscription" in why.lower(), listener.errors
        async with await Client.connect(nats_url, prefix, creds=admin_creds) as admin:
            await admin.jobs()
            assert admin.last_read is not None and admin.last_read.source == "view"
        assert sub.pending_msgs == 0
    finally:
        await listener.close()

    spoofer = await _Conn.open(nats_url, mallory)
    try:
        await spoofer.nc.publish(f"{prefix}.query.jobs.carol", b"", reply=spoofer.nc.new_inbox())
        why = await spoofer.violation()
        assert why is not None and "publish" in why.lower(), spoofer.errors
    finally:
        await spoofer.close()


async def test_an_answer_over_the_message_limit_comes_in_parts(
    nats_server: EmbeddedNats,
    bus: Bus,
    nats_url: str,
    prefix: str,
    admin_creds: str,
    admission: subprocess.Popen[bytes],
) -> None:
    """5,000 jobs with long names: the whole state is several times the server's 1 MiB
    message limit, yet ``state()`` comes from the view and equals a replay."""
    await wait_for_view(nats_url, prefix, admin_creds)
    await bus.publish_many(
        [
            ev.JobSubmitted(
                job_id=f"big-{i:05d}",
                spec=ev.JobSpec(user=f"u{i % 7}", name="n" * 256, max_gpus=1, total_iterations=10),
            )
            for i in range(5000)
        ]
    )
    async with await Client.connect(nats_url, prefix, creds=admin_creds) as client:
        viewed = await client.state()
        assert client.last_read is not None and client.last_read.source == "view", client.last_read
        replayed = await client.view("state", replay=True)
    encoded = st.encode_state(viewed)
    assert len(encoded) > 2 * nats_server.max_payload
    assert encoded == st.encode_state(replayed)

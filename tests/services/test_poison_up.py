"""Issue 20, end to end with `shoal up`: 32 random bytes published with plain nats-py
on the allocator's decision subject, a decision envelope holding a string that is not
UTF-8, and every other kind of bad message of tests/test_poison.py on its own subject
(invalid payloads, unknown types, future versions) must not stop scheduling, neither at once, nor
after the allocator is killed and restarted by the supervisor, nor after `shoal up`
is restarted on the same state directory (every service then replays the garbage).
Each bad message is dead-lettered once, however many processes replayed it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Header
from shoal.client import Client, NoAdmissionError
from shoal.commands.run import CLI_ARGV as CLI

from tests.services.test_up import alive, descendants, usable_policy, wait_line
from tests.test_poison import poison

pytestmark = pytest.mark.integration

SUBJECT = "shoal.alloc.shares_decided"


def start_up(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[str], str]:
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
        stderr=log.open("a"),
        text=True,
        env=env,
        start_new_session=True,
    )
    url = wait_line(proc, "NATS: ", 60).split(" ", 1)[1].strip()
    wait_line(proc, "running", 60)
    return proc, url


def stop_up(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def credentials(state_dir: Path) -> dict[str, Any]:
    """Keyword arguments that authenticate as the installation's admin, when `shoal up`
    made credentials (none otherwise)."""
    admin = state_dir / "creds" / "admin.nk"
    return {"creds": str(admin)} if admin.exists() else {}


def allocator_pids(up_pid: int) -> set[int]:
    out = set()
    for pid in descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"run" in argv and b"allocator" in argv:
            out.add(pid)
    return out


def not_utf8_decision() -> bytes:
    """A well-formed decision envelope whose id holds bytes that are not UTF-8 (the
    decoder raised UnicodeDecodeError past every reader's guard before)."""
    env = codec.wrap(ev.SharesDecided(epoch=10**6, shares={}), event_id="BADUTF8X")
    return codec.encode(env).replace(b"BADUTF8X", b"BAD\xffUTF8")


async def publish_garbage(url: str, state_dir: Path) -> int:
    """What the attacker did: plain nats-py, 32 random bytes, acked by JetStream; then
    a decision envelope with a string that is not UTF-8."""
    kwargs: dict[str, Any] = {}
    if creds := credentials(state_dir):
        kwargs = {"nkeys_seed": creds["creds"], "inbox_prefix": "_INBOX.admin"}
    nc = await nats.connect(url, **kwargs)
    try:
        await nc.jetstream().publish(SUBJECT, os.urandom(32))
        ack = await nc.jetstream().publish(SUBJECT, not_utf8_decision())
        for subject, data, _, _ in poison("shoal"):  # every other kind, on its own subject
            if subject != SUBJECT:
                ack = await nc.jetstream().publish(subject, data)
        return int(ack.seq)
    finally:
        await nc.close()


async def placed_within(client: Client, job_id: str, timeout_s: float) -> float:
    """Submit a one-GPU job; return the seconds from its acceptance until the placer
    gave it a GPU."""
    spec = ev.JobSpec(user="alice", max_gpus=1, requested_gpus=1, total_iterations=40)
    deadline = time.monotonic() + 60
    while True:  # after a restart, admission answers once it has replayed the log
        try:
            await client.submit(spec, job_id=job_id)
            break
        except NoAdmissionError:
            assert time.monotonic() < deadline, "admission never answered"
            await asyncio.sleep(0.2)
    t0 = time.monotonic()

    async def placed() -> None:
        async for env in client.job_events(job_id):
            if isinstance(env.event, ev.ReconfigurationRequested) and env.event.gpus:
                return

    await asyncio.wait_for(placed(), timeout_s)
    return time.monotonic() - t0


async def connect(url: str, state_dir: Path) -> Client:
    client = await Client.connect(url, "shoal", **credentials(state_dir))
    deadline = time.monotonic() + 60
    while len(await client.nodes()) < 2:
        assert time.monotonic() < deadline, "node daemons did not register"
        await asyncio.sleep(0.2)
    return client


def test_garbage_on_the_decision_subject_does_not_stop_scheduling(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    env["SHOAL_STATE_DIR"] = str(state_dir)
    log = tmp_path / "up.err"
    family: set[int] = set()

    async def first_run(url: str, up_pid: int) -> None:
        async with await connect(url, state_dir) as client:
            await placed_within(client, "before", 60)  # the stack works, a decision is on the subject
            await publish_garbage(url, state_dir)
            await placed_within(client, "after-garbage", 20)
            # The allocator dies; the supervisor of `shoal up` starts it again, and it
            # replays the garbage (the old code raised MalformedMessage here, five times).
            (old,) = allocator_pids(up_pid)
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not (allocator_pids(up_pid) - {old}):
                assert time.monotonic() < deadline, "the supervisor did not restart the allocator"
                await asyncio.sleep(0.1)
            await placed_within(client, "after-restart", 30)

    async def second_run(url: str) -> None:
        async with await connect(url, state_dir) as client:
            await placed_within(client, "after-up-again", 30)
            letters = [h for h, _ in await client.bus.dead_letters() if h.get(Header.DLQ_SUBJECT) == SUBJECT]
            assert len(letters) == 2, letters
            assert all(h[Header.DLQ_CODE] == "malformed" and h[Header.DLQ_REASON] for h in letters), letters
            assert "UTF-8" in letters[1][Header.DLQ_REASON], letters
            others = [h for h, _ in await client.bus.dead_letters()]
            for subject, _, code, word in poison("shoal"):
                if subject != SUBJECT:
                    assert any(
                        h.get(Header.DLQ_SUBJECT) == subject
                        and h[Header.DLQ_CODE] == code
                        and word in h[Header.DLQ_REASON]
                        for h in others
                    ), (subject, code, others)
            assert len(await client.bus.dead_letters()) == 2 + len(poison("shoal")) - 1

    proc, url = start_up(env, log)
    try:
        asyncio.run(first_run(url, proc.pid))
        family |= descendants(proc.pid)
    finally:
        stop_up(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
    proc, url = start_up(env, log)
    try:
        asyncio.run(second_run(url))
        family |= descendants(proc.pid)
    finally:
        stop_up(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if alive(p)], "processes left behind by shoal up"

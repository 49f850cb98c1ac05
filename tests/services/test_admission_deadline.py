"""Admission as a user runs it (``shoal run admission``, a real nats-server): requests
handled concurrently yet each job written once, per-user limits kept under concurrency,
no write after a request's deadline, and a client that retries after a lost answer
(admission stopped with SIGSTOP past the client's timeout) gets its job exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats.errors
import pytest
from shoal import admission
from shoal import events as ev
from shoal.bus import Bus
from shoal.client import Client, CommandError
from shoal.clock import WallClock

from tests.services.test_allocator_placer import events_of, wait_until
from tests.services.test_faults import Children, service_env

pytestmark = pytest.mark.integration


def spec(user: str) -> dict[str, object]:
    return {"user": user, "max_gpus": 1, "requested_gpus": 1, "total_iterations": 100}


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        for proc in kids.procs.values():  # a stopped child would never see SIGTERM
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        kids.stop_all()


async def start_admission(bus: Bus, nats_url: str, prefix: str, children: Children, tmp_path: Path) -> int:
    """``shoal run admission`` for ``prefix``; returns its pid once it answers requests."""
    proc = children.start(
        "admission", "admission", service_env(nats_url, prefix, WallClock(), tmp_path / "st")
    )
    deadline = time.monotonic() + 45
    while True:  # an empty request is rejected (invalid_command) and writes nothing
        assert proc.poll() is None, children.log("admission")
        try:
            await bus.nc.request(bus.names.cmd("submit_job"), b"", timeout=1)
            return proc.pid
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            assert time.monotonic() < deadline, children.log("admission")
            await asyncio.sleep(0.1)


async def submitted(bus: Bus) -> list[str]:
    return [e.job_id for e in await events_of(bus, ev.JobSubmitted)]


async def client_for(nats_url: str, prefix: str, admin_creds: str, **kw: float) -> Client:
    bus = await Bus.connect(nats_url, prefix=prefix, name="test-client", declare=False, creds=admin_creds)
    return Client(bus, **kw)  # type: ignore[arg-type]


async def test_concurrent_clients_are_all_answered_and_each_job_is_written_once(
    bus: Bus, nats_url: str, prefix: str, admin_creds: str, children: Children, tmp_path: Path
) -> None:
    await start_admission(bus, nats_url, prefix, children, tmp_path)
    clients = [await client_for(nats_url, prefix, admin_creds, timeout_s=30.0) for _ in range(8)]
    try:
        ids = await asyncio.gather(
            *(c.submit(spec(f"u{i % 3}")) for i, c in enumerate(clients) for _ in range(15))
        )
    finally:
        for c in clients:
            await c.close()
    assert len(set(ids)) == len(ids) == 120
    logged = await submitted(bus)
    assert sorted(logged) == sorted(ids)


async def test_a_user_limit_holds_when_the_users_submissions_arrive_at_once(
    bus: Bus, nats_url: str, prefix: str, admin_creds: str, children: Children, tmp_path: Path
) -> None:
    await bus.publish(ev.UserRegistered(user="lim", tickets=100, max_active_jobs=3))
    await start_admission(bus, nats_url, prefix, children, tmp_path)
    client = await client_for(nats_url, prefix, admin_creds, timeout_s=30.0)
    try:
        results = await asyncio.gather(
            *(client.submit(spec("lim")) for _ in range(12)), return_exceptions=True
        )
    finally:
        await client.close()
    accepted = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, CommandError) and r.code == "limit_exceeded"]
    assert len(accepted) == 3 and len(refused) == 9, results
    assert sorted(await submitted(bus)) == sorted(accepted)


async def test_a_request_whose_deadline_passed_writes_nothing(
    bus: Bus, nats_url: str, prefix: str, children: Children, tmp_path: Path
) -> None:
    pid = await start_admission(bus, nats_url, prefix, children, tmp_path)
    headers = {"Content-Type": "application/json"}
    body = {"type": "cmd.submit_job", "job_id": "late", "spec": spec("alice")}

    # Already past when sent.
    past = {**headers, admission.DEADLINE_HEADER: f"{time.time() - 1:.3f}"}
    reply = json.loads(
        (await bus.nc.request(bus.names.cmd("submit_job"), json.dumps(body).encode(), 5, headers=past)).data
    )
    assert reply["code"] == "deadline_exceeded", reply

    # Still ahead when sent, past by the time admission reads it: admission is stopped.
    inbox = bus.nc.new_inbox()
    answers = await bus.nc.subscribe(inbox)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.time() + 0.5
        soon = {**headers, admission.DEADLINE_HEADER: f"{deadline:.3f}"}
        body["job_id"] = "stalled"
        await bus.nc.publish(
            bus.names.cmd("submit_job"), json.dumps(body).encode(), reply=inbox, headers=soon
        )
        await bus.nc.flush()
        await wait_until(lambda: time.time() > deadline + 0.2, timeout=5)
    finally:
        os.kill(pid, signal.SIGCONT)
    reply = json.loads((await answers.next_msg(timeout=20)).data)
    assert reply["code"] == "deadline_exceeded", reply
    assert await submitted(bus) == []

    # The same request in time is written (so the refusals above were the deadline's).
    body["job_id"] = "in-time"
    ahead = {**headers, admission.DEADLINE_HEADER: f"{time.time() + 10:.3f}"}
    reply = json.loads(
        (await bus.nc.request(bus.names.cmd("submit_job"), json.dumps(body).encode(), 10, headers=ahead)).data
    )
    assert reply["type"] == "reply.accepted", reply
    assert await submitted(bus) == ["in-time"]


async def test_a_retry_after_no_answer_gets_the_one_job_written(
    bus: Bus, nats_url: str, prefix: str, admin_creds: str, children: Children, tmp_path: Path
) -> None:
    """Admission is stopped past the client's timeout: the client's first attempt gets no
    answer, it sends the same submission again, admission continues and answers; the
    client learns the id of the one job in the log."""
    pid = await start_admission(bus, nats_url, prefix, children, tmp_path)
    attempts: list[bytes] = []

    async def seen(msg: object) -> None:
        attempts.append(msg.data)  # type: ignore[attr-defined]

    await bus.nc.subscribe(bus.names.cmd("submit_job", "*"), cb=seen)  # a watcher, not a responder
    await bus.nc.flush()
    client = await client_for(nats_url, prefix, admin_creds, timeout_s=1.0, retries=20)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(client.submit(spec("alice")))
            await wait_until(lambda: len(attempts) >= 2 or task.done(), timeout=10)
        finally:
            os.kill(pid, signal.SIGCONT)
        job_id = await asyncio.wait_for(task, 30)
    finally:
        await client.close()
    keys = {msgspec.msgpack.decode(a)["job_id"] for a in attempts}
    assert len(attempts) >= 2 and keys == {job_id}, (len(attempts), keys)
    assert await submitted(bus) == [job_id]

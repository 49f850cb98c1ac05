"""The SDK and the CLI verbs end to end against a real nats-server and admission
service: submit, list, status, follow, cancel, tickets, nodes — and how the CLI finds
(or fails to find) the server."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.cli import CommandError as CliError
from shoal.client import Client, NoAdmissionError, NoEventLogError, UnknownJobError
from shoal.commands import _connect
from shoal_services.admission.service import AdmissionService

from tests.clients.conftest import RunCli

pytestmark = pytest.mark.integration

SPEC = {
    "user": "alice",
    "model": "resnet50",
    "min_gpus": 1,
    "max_gpus": 4,
    "requested_gpus": 2,
    "total_iterations": 1000,
}


def test_client_is_exported_from_the_package() -> None:
    import shoal

    assert shoal.Client is Client
    assert shoal.JobSpec is ev.JobSpec


async def test_sdk_submit_follow_and_read(bus: Bus, client: Client, service: AdmissionService) -> None:
    job_id = await client.submit(SPEC)
    assert len(job_id) == 26  # a ULID chosen by admission
    assert (await client.status(job_id)).status == "pending"
    events: list[ev.Envelope] = []

    async def follow() -> None:
        async for env in client.job_events(job_id, include_shares=True):
            events.append(env)

    follower = asyncio.create_task(follow())
    await bus.publish_many(
        [
            ev.SharesDecided(epoch=1, shares={job_id: 2}, policy="test", trigger="arrival"),
            ev.SharesDecided(epoch=2, shares={job_id: 2, "other": 1}, policy="test", trigger="arrival"),
            ev.PlacementDecided(epoch=2, placements={job_id: (ev.GpuRef("n0", 0), ev.GpuRef("n0", 1))}),
            ev.JobStarted(job_id=job_id, epoch=2),
            ev.ProgressReported(job_id=job_id, iteration=500),
            ev.JobCompleted(job_id=job_id, iterations=1000),
        ]
    )
    await asyncio.wait_for(follower, 30)  # ends by itself when the job completes
    assert [e.type for e in events] == [
        "job.submitted",
        "alloc.shares_decided",  # epoch 2 did not change this job's share: not yielded
        "alloc.placement_decided",
        "job.started",
        "job.progress",
        "job.completed",
    ]
    job = await client.status(job_id)
    assert (job.status, job.iteration) == ("completed", 1000)
    assert list(await client.jobs()) == [job_id]
    assert list(await client.nodes()) == ["n0"]
    # A finished job's history replays without following.
    replayed = [e.type async for e in client.job_events(job_id, follow=False)]
    assert replayed == ["job.submitted", "job.started", "job.progress", "job.completed"]
    with pytest.raises(UnknownJobError, match="no job 'ghost'"):
        await client.status("ghost")


async def test_sdk_cancel_and_tickets(bus: Bus, client: Client, service: AdmissionService) -> None:
    job_id = await client.submit(ev.JobSpec(user="alice", total_iterations=10), job_id="c1")
    assert job_id == "c1"
    reply = await client.cancel("c1", reason="changed my mind")
    assert reply.id == "c1" and not reply.duplicate
    assert (await client.cancel("c1")).duplicate, "cancelling a finished job is a no-op"
    job = await client.status("c1")
    assert (job.status, job.reason) == ("cancelled", "changed my mind")
    await client.set_tickets("alice", 300)
    assert (await client.state()).users["alice"].tickets == 300
    assert (await client.set_tickets("alice", 300)).duplicate


async def test_cli_verbs(bus: Bus, service: AdmissionService, run_cli: RunCli, tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "user: alice\nname: train-resnet\nmodel: resnet50\nmax_gpus: 4\nrequested_gpus: 2\ntotal_iterations: 1000\n"
    )
    rc, out, err = await run_cli("submit", str(job_file), "--job-id", "y1")
    assert (rc, out, err) == (0, "y1\n", "")
    rc, out, _ = await run_cli(
        "submit",
        "--user",
        "alice",
        "--max-gpus",
        "2",
        "--no-elastic",
        "--min-gpus",
        "2",
        "--requested-gpus",
        "2",
        "--iterations",
        "50",
        "--job-id",
        "f1",
        "--json",
    )
    assert rc == 0 and json.loads(out) == {
        "type": "reply.accepted",
        "id": "f1",
        "event_id": json.loads(out)["event_id"],
        "duplicate": False,
    }
    # A rejection with --json: the reply on stdout for scripts, the line on stderr, exit 1.
    rc, out, err = await run_cli("submit", "--user", "alice", "--min-gpus", "4", "--max-gpus", "2", "--json")
    assert rc == 1 and err.startswith("shoal: rejected (invalid_spec)"), (rc, out, err)
    reply = json.loads(out)
    assert reply["type"] == "reply.rejected" and reply["code"] == "invalid_spec" and reply["errors"]
    rc, out, _ = await run_cli("submit", "-", stdin=json.dumps({"user": "alice", "total_iterations": 5}))
    assert rc == 0 and len(out.strip()) == 26
    stdin_id = out.strip()
    await bus.publish_many(
        [
            ev.SharesDecided(epoch=1, shares={"y1": 2, "f1": 2}, policy="afs-l", trigger="arrival"),
            ev.PlacementDecided(
                epoch=1,
                placements={
                    "y1": (ev.GpuRef("n0", 0), ev.GpuRef("n0", 1)),
                    "f1": (ev.GpuRef("n0", 2), ev.GpuRef("n0", 3)),
                },
            ),
            ev.ProgressReported(job_id="y1", iteration=250),
            ev.GpuHealth(node_id="n0", index=0, utilization=0.5),
        ]
    )
    rc, out, _ = await run_cli("jobs")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:5] == ["JOB", "USER", "STATE", "GPUS", "PROGRESS"]
    assert any(line.split()[:5] == ["y1", "alice", "running", "2", "250/1000"] for line in lines)
    rc, out, _ = await run_cli("jobs", "--json")
    rows = {r["job_id"]: r for r in json.loads(out)}
    assert set(rows) == {"y1", "f1", stdin_id}
    assert rows["y1"]["gpus"] == 2 and rows["y1"]["progress"] == 0.25 and rows["y1"]["placement"] == "n0[0,1]"
    assert rows["f1"]["name"] == "" and rows["y1"]["name"] == "train-resnet"
    rc, out, _ = await run_cli("status", "y1")
    assert rc == 0 and "state     running" in out and "placement n0[0,1]" in out and "250/1000 25%" in out
    rc, out, _ = await run_cli("status", "y1", "--json")
    assert json.loads(out)["spec"]["model"] == "resnet50"
    rc, out, _ = await run_cli("nodes")
    assert rc == 0 and out.splitlines()[1].split()[:5] == ["n0", "up", "V100", "4/4", "12%"]
    rc, out, _ = await run_cli("nodes", "--json")
    assert json.loads(out)[0]["gpu_jobs"] == ["y1", "y1", "f1", "f1"]
    rc, out, _ = await run_cli("cancel", "f1", "--reason", "done with it")
    assert (rc, out) == (0, "cancelled f1\n")
    rc, out, _ = await run_cli("cancel", "f1")
    assert (rc, out) == (0, "job f1 had already finished; nothing changed\n")
    rc, out, _ = await run_cli("jobs", "--active", "--json")
    assert {r["job_id"] for r in json.loads(out)} == {"y1", stdin_id}
    rc, out, _ = await run_cli("tickets", "alice", "250")
    assert (rc, out) == (0, "user alice now has 250 tickets\n")
    assert service.projection.state.users["alice"].tickets == 250


async def test_cli_status_watch_follows_until_the_job_ends(
    bus: Bus, client: Client, service: AdmissionService, run_cli: RunCli
) -> None:
    await client.submit(SPEC, job_id="w1")
    watcher = asyncio.create_task(run_cli("status", "w1", "--watch"))
    # Events published before or after the watcher attaches are all shown: it replays, then follows.
    await bus.publish_many([ev.JobStarted(job_id="w1"), ev.JobCompleted(job_id="w1", iterations=1000)])
    rc, out, err = await asyncio.wait_for(watcher, 60)
    assert rc == 0, err
    assert out.splitlines()[-3:] == [
        line
        for line in out.splitlines()[-3:]
        if line.split("  ", 1)[1].startswith(("job.submitted", "job.started", "job.completed"))
    ]
    assert out.rstrip().endswith("job.completed w1")


async def test_finding_the_server(
    nats_url: str, prefix: str, tmp_path: Path, run_cli: RunCli, cli_env: dict
) -> None:
    env = {k: v for k, v in cli_env.items() if k not in ("NATS_URL", "SHOAL_PREFIX")}
    rc, _, err = await run_cli("jobs", env=env)
    assert (rc, err) == (2, "shoal: no NATS server: set NATS_URL or run `shoal up`\n")
    rc, _, err = await run_cli("jobs", "--nats-url", "nats://127.0.0.1:1", env=env)
    assert rc == 2 and "no NATS server reachable at nats://127.0.0.1:1" in err
    rc, _, err = await run_cli("jobs", "--nats-url", nats_url, "--prefix", "nothing-here", env=env)
    assert rc == 3 and "no shoal event log" in err and "'nothing-here'" in err
    rc, _, err = await run_cli("jobs", "--prefix", "bad prefix", env=cli_env)
    assert rc == 2 and "invalid subject prefix 'bad prefix'" in err
    # `shoal up` leaves the embedded server's ports file in the state dir.
    state = Path(env["SHOAL_STATE_DIR"]) / "nats"
    state.mkdir(parents=True)
    (state / "nats-server_999999999.ports").write_text(
        json.dumps({"nats": ["nats://127.0.0.1:1"]})
    )  # dead pid
    (state / f"nats-server_{os.getpid()}.ports").write_text(json.dumps({"nats": [nats_url]}))
    rc, _, err = await run_cli("jobs", "--prefix", prefix, env=env)
    assert rc == 3 and "no shoal event log" in err  # found the server; this prefix has no log yet


def test_resolution_order(tmp_path: Path) -> None:
    env = {"SHOAL_STATE_DIR": str(tmp_path)}
    with pytest.raises(CliError, match="no NATS server: set NATS_URL or run `shoal up`"):
        _connect.resolve_url(None, env)
    (tmp_path / "nats.url").write_text("nats://from-file:4222\n")
    assert _connect.resolve_url(None, env) == "nats://from-file:4222"
    # `shoal up` writes up.json with its pid beside nats.url; a dead one makes both stale.
    (tmp_path / "up.json").write_text(json.dumps({"url": "nats://from-file:4222", "pid": 999_999_999}))
    with pytest.raises(CliError, match="no NATS server"):
        _connect.resolve_url(None, env)
    for junk in ('{"url": "nats://x:1", "pid": null}', '{"url": "nats://x:1", "pid": "abc"}', "[1]", "{"):
        (tmp_path / "up.json").write_text(junk)  # a torn or hand-edited file: no server, no crash
        with pytest.raises(CliError, match="no NATS server"):
            _connect.resolve_url(None, env)
    (tmp_path / "up.json").write_text(json.dumps({"url": "nats://live:4222", "pid": os.getpid()}))
    assert _connect.resolve_url(None, env) == "nats://live:4222"
    assert _connect.resolve_url(None, {**env, "SHOAL_NATS_URL": "nats://b:1"}) == "nats://b:1"
    assert (
        _connect.resolve_url(None, {**env, "NATS_URL": "nats://a:1", "SHOAL_NATS_URL": "nats://b:1"})
        == "nats://a:1"
    )
    assert _connect.resolve_url("nats://flag:1", {**env, "NATS_URL": "nats://a:1"}) == "nats://flag:1"
    assert _connect.resolve_prefix(None, {}) == "shoal"
    assert _connect.resolve_prefix(None, {"SHOAL_PREFIX": "p1"}) == "p1"
    assert _connect.resolve_prefix("p2", {"SHOAL_PREFIX": "p1"}) == "p2"


async def test_no_admission_service_is_a_clear_error(bus: Bus) -> None:
    client = Client(bus, timeout_s=1.0)
    with pytest.raises(NoAdmissionError, match=r"no admission service answered on .*cmd\.submit_job") as info:
        await client.submit(SPEC)
    # The id every attempt carried, to submit again with (at most one job, whatever the
    # unanswered attempts did): rerunning without it would make a second job.
    job_id = info.value.job_id
    assert job_id and len(job_id) == 26 and f"submit again with job id {job_id}" in str(info.value)
    other = Client(
        await Bus.connect(
            bus.nc.connected_url.geturl() if bus.nc.connected_url else "",
            prefix="absent-x",
            declare=False,
            creds=os.environ["NATS_CREDS"],
        )
    )
    try:
        with pytest.raises(NoEventLogError, match="no shoal event log"):
            await other.jobs()
    finally:
        await other.close()
    assert codec.to_json(ev.CommandAccepted(id="x"))  # the reply types stay JSON-exportable


async def test_sdk_connect_finds_the_server_like_the_cli(
    bus: Bus,
    service: AdmissionService,
    nats_url: str,
    prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shoal.bus import NoServerError

    for var in ("NATS_URL", "SHOAL_NATS_URL", "SHOAL_PREFIX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SHOAL_STATE_DIR", str(tmp_path))
    with pytest.raises(NoServerError, match="no NATS server: set NATS_URL or run `shoal up`"):
        await Client.connect()
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("SHOAL_PREFIX", prefix)
    async with await Client.connect() as client:
        assert await client.submit(SPEC, job_id="env-1") == "env-1"
        assert list(await client.jobs()) == ["env-1"]

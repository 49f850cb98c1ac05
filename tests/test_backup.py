"""The event-log backups docs/deploy.md describes ("Backup and restore"): a copy of a
stopped server's JetStream store directory, and `shoal backup`/`shoal restore` through
the snapshot API of a running server or a three-server cluster (restored with three
replicas); each restored log is the same, and shoal folds it to the same state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nats
from shoal import codec, state
from shoal import events as ev
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats, LocalCluster

from tests.test_cluster import eventually


async def _log(url: str, admin: str, prefix: str = "shoal") -> tuple[int, list[tuple[int, bytes]], str]:
    bus = await Bus.connect(url, prefix, creds=admin, declare=False)
    try:
        last = await bus.last_seq()
        got = [(seq, codec.encode(env)) async for seq, env in bus.replay()]
        return last, got, state.digest(state.fold(codec.decode(b) for _, b in got))
    finally:
        await bus.close()


async def test_a_copy_of_a_stopped_servers_store_restores_the_log(tmp_path: Path) -> None:
    creds = CredentialStore(tmp_path / "creds")
    admin = str(creds.ensure("admin"))
    store = tmp_path / "jetstream"
    with EmbeddedNats(store_dir=store, creds_dir=creds.directory) as server:
        bus = await Bus.connect(server.url, "shoal", creds=admin)
        for i in range(50):
            await bus.publish(
                ev.JobSubmitted(job_id=f"j{i}", spec=ev.JobSpec(user="alice", total_iterations=100))
            )
        await bus.publish(ev.JobCancelled(job_id="j3"))
        await bus.close()
        before = await _log(server.url, admin)
    # The server is stopped (the with block): copy its store, as `cp -a` or a volume snapshot would.
    backup = tmp_path / "backup"
    shutil.copytree(store, backup)
    shutil.rmtree(store)
    with EmbeddedNats(store_dir=backup, creds_dir=creds.directory, server_name="another-host") as restored:
        after = await _log(restored.url, admin)
    assert before[0] == 51 and len(before[1]) == 51
    assert after == before


def _cli(*argv: str, url: str, creds: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env.update(NATS_URL=url, NATS_CREDS=creds)
    return subprocess.run(
        [sys.executable, "-c", "import sys; from shoal.cli import main; sys.exit(main())", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_shoal_backup_and_restore_through_the_snapshot_api(tmp_path: Path) -> None:
    creds = CredentialStore(tmp_path / "creds")
    admin = str(creds.ensure("admin"))
    allocator = str(creds.ensure("allocator"))
    backup = tmp_path / "backup"
    with EmbeddedNats(store_dir=tmp_path / "a", creds_dir=creds.directory) as server:
        bus = await Bus.connect(server.url, "shoal", creds=admin)
        for i in range(50):
            await bus.publish(
                ev.JobSubmitted(job_id=f"j{i}", spec=ev.JobSpec(user="alice", total_iterations=100))
            )
        await bus.publish(ev.JobCancelled(job_id="j3"))
        kv = await bus.js.create_key_value(bucket="SHOAL_LEASES_TEST")  # a bucket of the installation
        await kv.put("allocator", b"holder-1")
        await bus.close()
        before = await _log(server.url, admin)
        # Only the admin may snapshot: a service's identity is refused by the server.
        refused = _cli("backup", str(tmp_path / "nope"), "--timeout", "2", url=server.url, creds=allocator)
        assert refused.returncode != 0 and "only the admin identity" in refused.stderr
        assert not list((tmp_path / "nope").glob("*.snap"))
        made = _cli("backup", str(backup), url=server.url, creds=admin)  # while the server runs
        assert made.returncode == 0, made.stderr
        assert "SHOAL_EVENTS: 51 messages" in made.stdout
        assert "nats_error" not in made.stderr, made.stderr  # chunks without a reply are not acked
    with EmbeddedNats(store_dir=tmp_path / "b", creds_dir=creds.directory) as fresh:
        done = _cli("restore", str(backup), url=fresh.url, creds=admin)
        assert done.returncode == 0, done.stderr
        assert "SHOAL_EVENTS: 51 messages restored" in done.stdout
        after = await _log(fresh.url, admin)
        bus = await Bus.connect(fresh.url, "shoal", creds=admin, declare=False)
        try:
            kv = await bus.js.key_value("SHOAL_LEASES_TEST")
            assert (await kv.get("allocator")).value == b"holder-1"
        finally:
            await bus.close()
        again = _cli("restore", str(backup), url=fresh.url, creds=admin)
        assert again.returncode != 0 and "already has" in again.stderr
    assert after == before


async def _stream_replicas(bus: Bus, stream: str) -> tuple[int, str, list[bool]]:
    """``stream``'s configured replicas, its leader and whether each follower is current."""
    info = await bus.js.stream_info(stream)
    assert info.cluster is not None
    peers = info.cluster.replicas or []
    return (
        info.config.num_replicas or 1,
        info.cluster.leader or "",
        [p.current and not p.offline for p in peers],
    )


async def test_backup_of_a_three_replica_cluster_with_a_server_down_restores_replicated(
    nats_cluster: LocalCluster, nats_server: EmbeddedNats, prefix: str, tmp_path: Path
) -> None:
    """deploy.md's backup at R3: `shoal backup` of a 3-server cluster whose first seed is
    down (two of three servers still hold every stream), then `shoal restore` into a
    fresh 3-server cluster. The restored streams have three replicas again, every
    follower catches up, and the log reads the same, and folds to the same state, after
    the restored event stream's leading server is killed."""
    admin = os.environ["NATS_CREDS"]
    bus = await Bus.connect(nats_cluster.url, prefix, creds=admin)
    try:
        for i in range(40):
            await bus.publish(
                ev.JobSubmitted(job_id=f"j{i}", spec=ev.JobSpec(user="alice", total_iterations=100))
            )
        await bus.publish(ev.JobCancelled(job_id="j3"))
        events = bus.names.events_stream
        assert (await _stream_replicas(bus, events))[0] == 3
        await eventually(lambda: _all_current(bus, events))
    finally:
        await bus.close()
    before = await _log(nats_cluster.url, admin, prefix)
    backup = tmp_path / "backup"
    nats_cluster.kill(0)  # the seed list's first server
    try:
        # Once the other two answer (a new JetStream meta leader, if it was on the killed
        # server, is elected within seconds; meanwhile the command says so, see below).
        await eventually(lambda: _streams_listed(nats_cluster.url, admin))
        made = _cli("backup", str(backup), "--prefix", prefix, url=nats_cluster.url, creds=admin)
    finally:
        nats_cluster.restart(0)
    assert made.returncode == 0, made.stderr
    assert f"{events}: 41 messages" in made.stdout
    saved = json.loads((backup / f"{events}.json").read_text())
    assert saved["config"]["num_replicas"] == 3

    assert nats_server.creds_dir is not None
    with LocalCluster(tmp_path / "fresh", creds_dir=nats_server.creds_dir, prefix="*") as fresh:
        await eventually(lambda: _streams_listed(fresh.url, admin))  # a meta leader answers
        done = _cli("restore", str(backup), "--prefix", prefix, url=fresh.url, creds=admin)
        assert done.returncode == 0, done.stderr
        assert f"{events}: 41 messages restored" in done.stdout
        bus = await Bus.connect(fresh.url, prefix, creds=admin, declare=False)
        try:
            for item in json.loads((backup / "backup.json").read_text())["streams"]:
                assert (await _stream_replicas(bus, item["stream"]))[0] == 3, item
            await eventually(lambda: _all_current(bus, events))
            leader = (await _stream_replicas(bus, events))[1]
        finally:
            await bus.close()
        assert await _log(fresh.url, admin, prefix) == before
        fresh.kill(fresh.index_of(leader))  # the restored copy lives on the other two as well
        bus = await Bus.connect(fresh.url, prefix, creds=admin, declare=False)
        try:
            await eventually(lambda: _has_leader_other_than(bus, events, leader))
        finally:
            await bus.close()
        # Read as a service does: again while the servers left elect whatever leader the
        # killed one held (the consumer create waits on the meta leader).
        after: list[tuple[int, list[tuple[int, bytes]], str]] = []

        async def read() -> bool:
            after.append(await _log(fresh.url, admin, prefix))
            return True

        await eventually(read, timeout_s=60.0)
        assert after[-1] == before


async def _all_current(bus: Bus, stream: str) -> bool:
    _, _, current = await _stream_replicas(bus, stream)
    return len(current) == 2 and all(current)


async def _has_leader_other_than(bus: Bus, stream: str, old: str) -> bool:
    leader = (await _stream_replicas(bus, stream))[1]
    return bool(leader) and leader != old


async def _streams_listed(url: str, admin: str) -> bool:
    nc = await nats.connect(servers=url.split(","), nkeys_seed=admin)
    try:
        await nc.jetstream(timeout=1.0).streams_info()
        return True
    finally:
        await nc.close()


def test_a_jetstream_that_does_not_answer_is_a_clear_error_not_a_traceback() -> None:
    """While a cluster elects a new leader, JetStream's API requests time out: `shoal
    backup` and `shoal restore` then exit 1 with a message that says so (they printed a
    traceback)."""
    import nats.errors
    import pytest
    from shoal.cli import CommandError
    from shoal.commands.backup import _run

    async def silent() -> int:
        raise nats.errors.TimeoutError

    with pytest.raises(CommandError, match=r"did not answer within 3 s .*run the command again") as info:
        _run(silent, 3.0)
    assert info.value.code == 1

"""The event-log backups docs/deploy.md describes ("Backup and restore"): a copy of a
stopped server's JetStream store directory, and `shoal backup`/`shoal restore` through
the snapshot API of a running server; each restored log is the same, and shoal folds it
to the same state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from shoal import codec, state
from shoal import events as ev
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats


async def _log(url: str, admin: str) -> tuple[int, list[tuple[int, bytes]], str]:
    bus = await Bus.connect(url, "shoal", creds=admin, declare=False)
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

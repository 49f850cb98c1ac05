"""The event-log backup docs/deploy.md describes ("Backup and restore"): a copy of a
stopped server's JetStream store directory, started by a new server, holds the same
log, and shoal folds it to the same state."""

from __future__ import annotations

import shutil
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

"""`shoal leaders` against an installation started as a user starts it (`shoal up`):
it names the process that holds each service's lease, a client identity may run it,
and after the leading allocator is killed it names the allocator that took over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from shoal.commands.run import CLI_ARGV
from shoal.settings import default_node_id

from tests.services.test_liveness import shoal_up, wait_until

pytestmark = pytest.mark.integration


def shoal(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
    done = subprocess.run([*CLI_ARGV, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    return done


def leaders(tmp_path: Path, *args: str) -> dict[str, str]:
    rows = json.loads(shoal(tmp_path, "leaders", "--json", *args).stdout)
    return {row["lease"]: row["holder"] for row in rows}


async def test_leaders_names_each_lease_holder_and_follows_a_takeover(tmp_path: Path) -> None:
    async with shoal_up(tmp_path, nodes=0) as up:
        host = default_node_id()
        pids = {s: up.pid_of("run", s) for s in ("allocator", "placer", "profiler", "trader")}
        want = {s: f"{s}-{host}-{pid}" for s, pid in pids.items()}
        await wait_until(lambda: leaders(tmp_path) == want, 30, f"the leases held by {want}")
        table = shoal(tmp_path, "leaders").stdout
        assert table.splitlines()[0].split() == ["LEASE", "HOLDER"], table
        assert f"allocator  {want['allocator']}" in table, table

        seed = shoal(tmp_path, "creds", "add", "user", "alice").stdout.split()[0]
        assert leaders(tmp_path, "--creds", seed) == want  # any identity may read them

        os.kill(pids["allocator"], signal.SIGKILL)
        await wait_until(
            lambda: leaders(tmp_path).get("allocator", want["allocator"]) != want["allocator"],
            60,
            "a new allocator holding the lease",
        )
        new = up.pid_of("run", "allocator")
        assert leaders(tmp_path)["allocator"] == f"allocator-{host}-{new}"

"""Settings given to `shoal up` reach what they configure: ``SHOAL_METRICS_PORT`` gives
the children consecutive probe ports from it, ``SHOAL_SYNC_INTERVAL`` is in the
configuration the embedded nats-server runs, and a service whose probe port is taken
exits with status 2 and a one-line message (docs/operations.md, docs/deploy.md)."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
from pathlib import Path

import pytest
from shoal.commands.run import CLI_ARGV as CLI
from shoal.faults import _scrape

from tests.services.test_liveness import run_job, shoal_up

pytestmark = pytest.mark.integration


def _all_free(base: int, n: int) -> bool:
    with contextlib.ExitStack() as held:
        for port in range(base, base + n):
            sock = held.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_run(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        if _all_free(base, n):
            return base
    raise RuntimeError("no run of free ports")


async def test_probe_ports_sync_interval_and_a_taken_port(tmp_path: Path) -> None:
    base = _free_run(12)
    async with shoal_up(tmp_path, nodes=1, SHOAL_METRICS_PORT=str(base), SHOAL_SYNC_INTERVAL="always") as up:
        info = json.loads((tmp_path / "state" / "up.json").read_text())
        ports = sorted(int(url.rsplit(":", 1)[1]) for url in info["metrics"].values())
        assert ports == list(range(base, base + len(ports))) and len(ports) >= 5, ports
        assert all(_scrape(url + "/healthz")[0] == 200 for url in info["metrics"].values())

        argv = Path(f"/proc/{info['server_pid']}/cmdline").read_bytes().split(b"\0")
        conf = Path(argv[argv.index(b"-c") + 1].decode())
        assert "sync_interval: always" in conf.read_text()
        assert '"auth_callout"' in conf.read_text()  # on by default

        admission = up.pid_of("run", "admission")
        raw = Path(f"/proc/{admission}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        env["SHOAL_METRICS_PORT"] = str(base)  # a sibling's port
        taken = subprocess.run(
            [*CLI, "run", "admission"], env=env, capture_output=True, text=True, timeout=60
        )
        assert taken.returncode == 2, (taken.returncode, taken.stderr[-2000:])
        lines = [line for line in taken.stderr.splitlines() if str(base) in line]
        assert lines and "Traceback" not in taken.stderr, taken.stderr[-2000:]


async def test_without_the_auth_callout_sidecars_use_their_nodes_static_identity(tmp_path: Path) -> None:
    """``SHOAL_AUTH_CALLOUT=false`` (docs/security.md's escape hatch): no authorizer runs,
    the server lists every identity itself, and a job still runs to completion (its
    sidecar connects with its node's static sidecar identity)."""
    async with shoal_up(tmp_path, nodes=1, SHOAL_AUTH_CALLOUT="false") as up:
        info = json.loads((tmp_path / "state" / "up.json").read_text())
        assert "authorizer" not in info["metrics"], info["metrics"]
        argv = Path(f"/proc/{info['server_pid']}/cmdline").read_bytes().split(b"\0")
        conf = Path(argv[argv.index(b"-c") + 1].decode()).read_text()
        assert '"auth_callout"' not in conf  # the default's block (the other test sees it)
        assert await run_job(up, "no-callout", 2) == {"node0"}

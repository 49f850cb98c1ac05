"""Start order: a process whose identity may not create streams, started before any
service has declared them, waits for them instead of exiting.

CI's compose stack lost both node daemons this way: each published its registration
before admission (or any other service) had declared the event stream, the publish
found no stream, and the daemon exited 1. podman-compose never restarted it (its
container requires the one-shot ``nats-config``, which had exited), so the stack
never became ready. The node daemon is started here as a user starts it,
``shoal run node-daemon`` with a node's own seed."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats

from tests.conftest import add_identity
from tests.services.test_probes_up import get
from tests.test_tracing_e2e import stop_process

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int:
    """The probe's HTTP status; 0 while nothing listens."""
    try:
        return get(url)[0]
    except OSError:
        return 0


async def test_a_node_daemon_started_before_the_streams_waits_and_registers(
    nats_server: EmbeddedNats, prefix: str, tmp_path: Path
) -> None:
    seed = add_identity(nats_server, "node", "early")
    port = _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SHOAL_") and k not in ("NATS_URL", "NATS_CREDS")
    }
    env.update(
        SHOAL_NATS_URL=nats_server.url,
        SHOAL_NATS_CREDS=seed,
        SHOAL_PREFIX=prefix,
        SHOAL_NODE_ID="early",
        SHOAL_FAKE_GPUS="2",
        SHOAL_METRICS_PORT=str(port),
        SHOAL_STATE_DIR=str(tmp_path / "state"),
        SHOAL_LOG_FORMAT="json",
    )
    log_path = tmp_path / "node-daemon.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "run", "node-daemon"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    readyz = f"http://127.0.0.1:{port}/readyz"
    try:
        # Up (its probes answer) but not ready, and still running well past the 5 s a
        # publish waits for a stream: no stream exists under this prefix yet.
        deadline = time.monotonic() + 30
        while _status(readyz) != 503:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            await asyncio.sleep(0.2)
        await asyncio.sleep(7)
        assert proc.poll() is None, log_path.read_text()
        assert _status(readyz) == 503
        assert "waiting_for_stream" in log_path.read_text()

        # A service declares the streams: the node registers and becomes ready.
        admin = await Bus.connect(nats_server.url, prefix=prefix, creds=os.environ["NATS_CREDS"])
        try:
            deadline = time.monotonic() + 30
            registered: list[ev.NodeRegistered] = []
            while not registered:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                await asyncio.sleep(0.3)
                registered = [
                    e.event
                    async for _, e in admin.replay()
                    if isinstance(e.event, ev.NodeRegistered) and e.event.node_id == "early"
                ]
            assert len(registered[0].gpus) == 2
            while _status(readyz) != 200:
                assert time.monotonic() < deadline, log_path.read_text()
                await asyncio.sleep(0.2)
        finally:
            await admin.close()
    finally:
        stop_process(proc)

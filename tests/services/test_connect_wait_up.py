"""SHOAL_CONNECT_WAIT_S: a service started before its NATS server waits for it, as
`shoal run` is started by compose or Kubernetes next to a forming cluster, and exits
with status 2 when the wait runs out (0, the default: at once)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.auth import CredentialStore
from shoal.client import Client
from shoal.commands.run import CLI_ARGV
from shoal.nats_server import EmbeddedNats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    return {**base, "SHOAL_LOG_FORMAT": "json", **extra}


def test_admission_started_before_its_server_waits_and_then_serves(tmp_path: Path) -> None:
    port = _free_port()
    url = f"nats://127.0.0.1:{port}"
    creds = CredentialStore(tmp_path / "creds")
    admin = creds.ensure("admin")
    admission = subprocess.Popen(
        [*CLI_ARGV, "run", "admission"],
        env=_env(NATS_URL=url, NATS_CREDS=str(admin), SHOAL_PREFIX="wait", SHOAL_CONNECT_WAIT_S="60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # It is waiting (no server yet), not gone.
        assert admission.stderr is not None
        deadline = time.monotonic() + 30
        for line in admission.stderr:
            if "waiting_for_nats" in line:
                break
            assert time.monotonic() < deadline, "no waiting_for_nats line"
        assert admission.poll() is None
        with EmbeddedNats(store_dir=tmp_path / "js", port=port, creds_dir=creds.directory, prefix="*"):

            async def submit() -> str:
                async with await Client.connect(url, "wait", creds=str(admin)) as client:
                    deadline = time.monotonic() + 60
                    while True:  # admission answers once it has connected and declared
                        try:
                            return await client.submit(
                                ev.JobSpec(user="alice", max_gpus=1, total_iterations=10), job_id="late"
                            )
                        except Exception:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.5)

            assert asyncio.run(submit()) == "late"
            assert admission.poll() is None
    finally:
        admission.terminate()
        admission.wait(timeout=30)


@pytest.mark.slow  # 9 s of waiting by design; the default run has the waiting path above
def test_the_wait_runs_out_with_status_2_and_says_so() -> None:
    url = f"nats://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run(
        [*CLI_ARGV, "run", "placer"],
        env=_env(NATS_URL=url, SHOAL_CONNECT_WAIT_S="8"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"no NATS server reachable at {url}" in proc.stderr
    assert proc.stderr.count("waiting_for_nats") >= 1
    assert time.monotonic() - t0 >= 8

"""Fixtures for the client tests: a real admission service on the session's nats-server,
and a helper that runs the real ``shoal`` CLI in a subprocess."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path

import pytest
from shoal import admission
from shoal import events as ev
from shoal.bus import Bus
from shoal.client import Client
from shoal.projection import Projection
from shoal_services.admission.service import AdmissionService

CliResult = tuple[int, str, str]
RunCli = Callable[..., Coroutine[None, None, CliResult]]


@pytest.fixture
async def service(bus: Bus) -> AsyncIterator[AdmissionService]:
    """Admission with one 4×V100 node, users enforced, alice registered."""
    await bus.publish_many(
        [
            ev.NodeRegistered(
                node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(4))
            ),
            ev.UserRegistered(user="alice", tickets=100),
        ]
    )
    projection = Projection(bus)
    await projection.start()
    await projection.wait_ready()
    svc = AdmissionService(bus, projection, admission.Limits(enforce_users=True))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()
        await projection.stop()


@pytest.fixture
async def client(bus: Bus, service: AdmissionService) -> Client:
    return Client(bus, timeout_s=5.0)


@pytest.fixture
def cli_env(nats_url: str, prefix: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "SHOAL_"))}
    env.update(NATS_URL=nats_url, SHOAL_PREFIX=prefix, SHOAL_STATE_DIR=str(tmp_path / "state"))
    env["NATS_CREDS"] = os.environ["NATS_CREDS"]  # the admin's, as an operator's shell has it
    return env


@pytest.fixture
def run_cli(cli_env: dict[str, str]) -> RunCli:
    """Run the ``shoal`` CLI with ARGS in a real process without blocking the test's event loop (the
    services under test run in it). Returns (exit status, stdout, stderr)."""

    async def run(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> CliResult:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            # Not `-m shoal.cli`: that would load the CLI twice (as __main__ and as shoal.cli).
            "import sys; from shoal.cli import main; sys.exit(main())",
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env if env is not None else cli_env,
        )
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    return run

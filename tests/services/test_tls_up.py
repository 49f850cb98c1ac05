"""TLS through the shipped path: `shoal up` given a certificate (``SHOAL_TLS_CERT``,
``SHOAL_TLS_KEY``, ``SHOAL_TLS_CA``, made by the test) runs every child over TLS (the
services, the authorizer, the node daemon and the job's sidecar), a job completes, the
CLI reads it over TLS, and a plain-TCP client gets nowhere."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from shoal.bus import Bus, NoServerError
from shoal.commands.run import CLI_ARGV as CLI

from tests.services.test_liveness import run_job, shoal_up
from tests.test_auth import self_signed

pytestmark = pytest.mark.integration


async def test_shoal_up_with_a_certificate_runs_a_job_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    tls = {"SHOAL_TLS_CERT": str(cert), "SHOAL_TLS_KEY": str(key), "SHOAL_TLS_CA": str(cert)}
    async with shoal_up(tmp_path, nodes=1, **tls) as up:
        assert up.url.startswith("tls://"), up.url
        monkeypatch.setenv("SHOAL_TLS_CA", str(cert))  # how the SDK finds the CA
        assert await run_job(up, "tls-job", 2) == {"node0"}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env |= {"SHOAL_STATE_DIR": str(tmp_path / "state"), "SHOAL_TLS_CA": str(cert)}
        listed = subprocess.run([*CLI, "jobs", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert [j["status"] for j in json.loads(listed.stdout) if j["job_id"] == "tls-job"] == ["completed"]
        assert "replayed" not in listed.stderr  # admission's view answered, over TLS
        # The admin's commands find the CA the same way (shoal compact as shoal up runs it).
        compacted = subprocess.run(
            [*CLI, "compact", "--dry-run"], env=env, capture_output=True, text=True, timeout=120
        )
        assert compacted.returncode == 0, compacted.stderr
        assert "unchanged" in compacted.stdout, compacted.stdout
        with pytest.raises(NoServerError):
            await Bus.connect(
                up.url.replace("tls://", "nats://"),
                prefix="shoal",
                initial_connect_timeout_s=2.0,
                **up.admin(),
            )

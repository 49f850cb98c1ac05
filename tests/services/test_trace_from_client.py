"""A trace begins at the client: one submission through `shoal up` is one trace from the
SDK's request through admission, the allocator's decision, the placement and the node
daemon's and sidecar's reconfiguration, every process writing its spans to one
JSON-lines file (``SHOAL_TRACE_JSONL``); node daemons and sidecars name their node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from shoal.commands.run import CLI_ARGV

pytestmark = pytest.mark.integration

CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from shoal.client import Client
    from shoal.telemetry import setup_tracing

    SPEC = {"user": "alice", "max_gpus": 1, "total_iterations": 10**6}

    async def main(url, creds):
        async with await Client.connect(url, "shoal", creds=creds) as client:
            for _ in range(60):  # admission may still be starting
                try:
                    await client.submit(SPEC, job_id="warm-up")
                    break
                except Exception as exc:
                    if type(exc).__name__ != "NoAdmissionError":
                        raise
                    await asyncio.sleep(0.5)
            # Once the warm-up job holds a GPU an allocator leads, so the next submission
            # is decided on as an arrival (not in the new leader's take-over decision).
            for _ in range(120):
                if (await client.status("warm-up")).gpus:
                    break
                await asyncio.sleep(0.25)
            await client.submit(SPEC, job_id="traced")

    tracing = setup_tracing("test-client", trace_jsonl=sys.argv[3])
    asyncio.run(main(sys.argv[1], sys.argv[2]))
    tracing.shutdown()
    """
)


def spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_submission_is_one_trace_from_the_client_to_the_sidecar(tmp_path: Path) -> None:
    jsonl = tmp_path / "spans.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_", "OTEL_"))}
    env.update(SHOAL_STATE_DIR=str(tmp_path / "state"), SHOAL_TRACE_JSONL=str(jsonl))
    up = subprocess.Popen(
        [*CLI_ARGV, "up", "--nodes", "1", "--gpus-per-node", "2", "--time-scale", "10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.err").open("w"),
        text=True,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None
        url = ""
        deadline = time.monotonic() + 60
        while not url:
            line = up.stdout.readline()
            assert line and time.monotonic() < deadline, "shoal up did not start"
            if line.startswith("NATS: "):
                url = line.split(" ", 1)[1].strip()
        admin = str(tmp_path / "state" / "creds" / "admin.nk")
        subprocess.run(
            [sys.executable, "-c", CLIENT, url, admin, str(jsonl)], env=env, check=True, timeout=90
        )
        # The traced submission is the client's last.
        root = [s for s in spans(jsonl) if s["name"] == "client.submit_job"][-1]
        trace_id = root["trace_id"]

        def names() -> dict[str, set[str]]:
            out: dict[str, set[str]] = {}
            for s in spans(jsonl):
                if s["trace_id"] == trace_id:
                    out.setdefault(s["service"], set()).add(s["name"])
            return out

        deadline = time.monotonic() + 60
        while "sidecar.reconfigure" not in names().get("trainer-sidecar", set()):
            assert time.monotonic() < deadline, names()
            time.sleep(0.2)
        seen = names()
        assert "test-client" in seen and "admission" in seen, seen
        assert "allocator.decide" in seen["allocator"], seen
        assert seen.get("placer") and seen.get("node-daemon"), seen
        nodes = {
            s["node"] for s in spans(jsonl) if s["trace_id"] == trace_id and s["service"] != "test-client"
        }
        assert "node0" in nodes, nodes
        # `shoal submit` starts the trace the same way when the user exports spans.
        cli = subprocess.run(
            [*CLI_ARGV, "submit", "--user", "alice", "--max-gpus", "1", "--iterations", "1000000",
             "--job-id", "cli-traced", "--nats-url", url, "--creds", admin],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        [cli_root] = [
            s for s in spans(jsonl) if s["service"] == "shoal-cli" and s["name"] == "client.submit_job"
        ]
        deadline = time.monotonic() + 30
        while not any(
            s["service"] == "admission" and s["trace_id"] == cli_root["trace_id"] for s in spans(jsonl)
        ):
            assert time.monotonic() < deadline, "admission did not continue the CLI's trace"
            time.sleep(0.2)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(30)


def test_otel_service_name_is_honoured(tmp_path: Path) -> None:
    """In a process of its own (the tracer provider is process-wide)."""
    jsonl = tmp_path / "s.jsonl"
    code = (
        "import sys; from opentelemetry import trace; from shoal.telemetry import setup_tracing\n"
        "t = setup_tracing('admission', trace_jsonl=sys.argv[1], node_id='gpu-7')\n"
        "trace.get_tracer('x').start_span('s').end(); t.shutdown()"
    )
    env = {**os.environ, "OTEL_SERVICE_NAME": "admission-eu1"}
    subprocess.run([sys.executable, "-c", code, str(jsonl)], env=env, check=True, timeout=60)
    [span] = spans(jsonl)
    assert (span["service"], span["node"]) == ("admission-eu1", "gpu-7")

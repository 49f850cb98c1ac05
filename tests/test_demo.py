"""`shoal demo` on a reduced slice: real processes, real server, real Philly jobs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from shoal.commands.run import CLI_ARGV as CLI
from shoal.commands.run import CONTROL_PLANE, service_available

pytestmark = pytest.mark.integration


def _hours(text: str, label: str) -> float:
    m = re.search(rf"^\s*{label}\s+([0-9.]+) h$", text, flags=re.M)
    assert m, f"no {label!r} line in:\n{text}"
    return float(m.group(1))


def bounds(jobs: int, gpus: int) -> tuple[float, float, float]:
    """(mean fastest possible run time, makespan lower bound, one-GPU serial makespan), hours.

    A job can go no faster than its best speed on at most ``gpus`` GPUs; the cluster can
    do no more than ``gpus`` GPU-hours per hour, and a job uses the fewest GPU-hours on
    one GPU (speedups are sublinear); one job after the other on one GPU each is slower
    than any work-conserving schedule."""
    from shoal.workloads import load_philly

    trace = load_philly("0e4a51", limit=jobs)
    t0 = min(j.submit_time_s for j in trace)
    fastest, gpu_hours, serial = [], 0.0, 0.0
    for j in trace:
        iters = float(j.spec.total_iterations or 0)
        top = min(j.spec.max_gpus, gpus, len(j.throughput) - 1)
        fastest.append((j.submit_time_s - t0, iters / max(j.throughput[1 : top + 1]) / 3600))
        gpu_hours += min(k * iters / j.throughput[k] for k in range(1, top + 1)) / 3600
        serial = max(serial, (j.submit_time_s - t0) / 3600) + iters / j.throughput[1] / 3600
    mean_fastest = sum(f for _, f in fastest) / len(fastest)
    lower = max(max(a / 3600 + f for a, f in fastest), gpu_hours / gpus)
    return mean_fastest, lower, serial


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def log_lines(out: str) -> list[dict[str, object]]:
    """The demo's log (its path is printed): JSON objects, one per line, except that
    the processes share the file and a logger writes a line and its newline apart, so
    two processes logging at the same instant can leave two objects on one line."""
    m = re.search(r"^logs: (\S+)$", out, flags=re.M)
    assert m, out
    decoder = json.JSONDecoder()
    entries = []
    for line in Path(m.group(1)).read_text().splitlines():
        i = 0
        while line.startswith("{", i):
            entry, i = decoder.raw_decode(line, i)
            entries.append(entry)
    return entries


def test_reduced_demo_prints_results_and_exits_0() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    proc = subprocess.run(
        [
            *CLI,
            "demo",
            "--jobs",
            "5",
            "--time-scale",
            "5000",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--tick",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr[-3000:]}"
    assert "5 jobs of Philly VC 0e4a51" in out
    progress = [line for line in out.splitlines() if line.startswith("t=")]
    assert len(progress) >= 2
    assert re.search(r"done\s+5/5", progress[-1]), progress[-1]
    assert re.search(r"^\s*jobs completed\s+5/5$", out, flags=re.M), out
    avg, median, p99, makespan = (
        _hours(out, k) for k in ("average JCT", "median JCT", "p99 JCT", "makespan")
    )
    assert 0 < median <= p99 <= makespan
    assert 0 < avg <= makespan
    # Bounds from the trace itself (2 nodes x 2 GPUs), whatever the policy:
    lower_jct, lower_makespan, serial = bounds(jobs=5, gpus=4)
    assert avg >= lower_jct * 0.99
    assert makespan >= lower_makespan * 0.99
    assert makespan <= serial * 1.5
    util = re.search(r"GPU utilisation\s+([0-9.]+)%", out)
    assert util and 0 < float(util.group(1)) <= 100.0
    # Service logs went to the log file, not the terminal.
    assert "job_completed" not in out

    # The services ran as separate supervised processes, as under `shoal up` ...
    log = log_lines(out)
    started = {str(e["name"]): int(e["pid"]) for e in log if e.get("event") == "child_started"}  # type: ignore[call-overload]
    services = [n for n in CONTROL_PLANE if service_available(n)]
    assert {"admission", "allocator", "placer"} <= set(services)
    # (the authorizer answers the server's auth callout: per-job sidecar identities)
    assert set(started) == {"authorizer", *services, "node-daemon-node0", "node-daemon-node1"}, started
    assert len(set(started.values())) == len(started)
    # ... each of which stopped cleanly (sidecars too, stopped by their node daemon) ...
    clean = [e["service"] for e in log if e.get("event") == "stopped" and e.get("clean")]
    assert {n if not n.startswith("node-daemon-") else "node-daemon" for n in started} <= set(clean), clean
    assert "trainer-sidecar" in clean
    assert not [e for e in log if e.get("level") == "error"], [e for e in log if e.get("level") == "error"]
    assert "did not exit cleanly" not in proc.stderr
    # ... and the profiler's models are in the log.
    m = re.search(r"(\d+) share decisions, (\d+) throughput models from the profiler", out)
    assert m and int(m.group(1)) > 0, out
    if "profiler" in services:
        assert int(m.group(2)) > 0, out
    # Nothing is left behind: no service, no sidecar.
    pids = set(started.values()) | {int(e["pid"]) for e in log if e.get("event") == "sidecar_started"}  # type: ignore[call-overload]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left behind by shoal demo"


def test_demo_rejects_bad_arguments_without_starting_anything() -> None:
    for argv, needle in (
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--vc", "nope"], "unknown Philly VC 'nope'"),
        (["--policy", "no-such-policy"], "unknown policy 'no-such-policy'"),
        (["--state-dir", "/tmp/not-used"], "--state-dir is for shoal up"),
    ):
        proc = subprocess.run([*CLI, "demo", *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr
        assert "NATS:" not in proc.stdout

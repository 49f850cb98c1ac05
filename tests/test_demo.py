"""`shoal demo` on a reduced slice: real processes, real server, real Philly jobs."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from shoal.commands.run import CLI_ARGV as CLI

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


def test_demo_rejects_bad_arguments_without_starting_anything() -> None:
    for argv, needle in (
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--vc", "nope"], "unknown Philly VC 'nope'"),
        (["--policy", "no-such-policy"], "unknown policy 'no-such-policy'"),
    ):
        proc = subprocess.run([*CLI, "demo", *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr
        assert "NATS:" not in proc.stdout

"""The GPU scripts' self-checks on CPU: ``benchmarks/real_mode_gpu.sh`` (real mode through
the CLI a user runs, here on one emulated GPU) and ``benchmarks/bench_gpu.py --device cpu``.
On a GPU machine they are the device checks; here they prove the scripts themselves work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _env(**extra: str) -> dict[str, str]:
    """This environment without the test session's NATS server and credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "SHOAL_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return {**env, **extra}


@pytest.mark.timeout(600)
def test_real_mode_through_the_cli_on_an_emulated_gpu(tmp_path: Path) -> None:
    report = tmp_path / "real_mode.md"
    out = subprocess.run(
        ["bash", "benchmarks/real_mode_gpu.sh", str(report)],
        cwd=REPO,
        env=_env(FAKE="1", STEPS="300", PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = report.read_text()
    assert "progress  300/300 100%" in text and "state     completed" in text, text
    assert "done step 300" in text, text  # the worker's own log
    assert "error lines in the node daemon log: 0" in text, text
    assert "gpu0/0 1.00" in text, text  # the emulated GPU reported busy while the job ran


@pytest.mark.timeout(600)
def test_bench_gpu_self_check_on_cpu(tmp_path: Path) -> None:
    report = tmp_path / "gpu.md"
    argv = ["benchmarks/bench_gpu.py", "--device", "cpu", "--reps", "1", "--steps", "100"]
    out = subprocess.run(
        [sys.executable, *argv, "--out", str(report)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = report.read_text()
    assert "no step lost" in text, text
    assert "| 1 → 2 | scale_out |" in text and "| 2 → 1 | scale_in |" in text, text
    assert "| shoal.train (sidecar) |" in text, text

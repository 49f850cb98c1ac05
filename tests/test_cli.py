"""The console script: discovery of commands, `shoal run` errors, `shoal schemas`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
from shoal import cli
from shoal.commands import run as run_cmd
from shoal.commands.run import CLI_ARGV, SERVICES

pytestmark = pytest.mark.integration  # real processes


def shoal(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    return subprocess.run(
        [*CLI_ARGV, *argv], capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})}
    )


def test_help_lists_the_commands() -> None:
    proc = shoal("--help")
    assert proc.returncode == 0
    for command in ("run", "up", "demo", "schemas"):
        assert command in proc.stdout


def test_run_help_lists_every_service() -> None:
    proc = shoal("run", "--help")
    assert proc.returncode == 0
    for name in SERVICES:
        assert name in proc.stdout
    assert set(SERVICES) == {
        "admission",
        "profiler",
        "allocator",
        "placer",
        "trader",
        "node-daemon",
        "trainer-sidecar",
        "authorizer",
    }


def test_run_unknown_service_is_a_clear_error() -> None:
    proc = shoal("run", "nonexistent")
    assert proc.returncode == 2
    assert proc.stderr.startswith("shoal: unknown service 'nonexistent'; services: admission")
    assert "Traceback" not in proc.stderr


def test_run_missing_service_module_says_not_implemented(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        run_cmd,
        "SERVICES",
        MappingProxyType({**SERVICES, "ghost": ("shoal_services.ghost.main", "not built")}),
    )
    assert cli.main(["run", "ghost"]) == 3
    assert "service ghost is not implemented yet" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["run", "admission"], {"SHOAL_TIME_SCALE": "abc"}, "SHOAL_TIME_SCALE='abc': expected a number"),
        (
            ["run", "admission", "--log-format", "xml"],
            {},
            "--log-format='xml': expected one of auto, json, pretty",
        ),
        (["run", "allocator", "--policy-param", "novalue"], {}, "--policy-param expects KEY=VALUE"),
        (["run", "trainer-sidecar"], {}, "trainer-sidecar needs --job JOB_ID --node NODE_ID"),
        (["run", "admission", "--job", "j1"], {}, "--job/--node are options of trainer-sidecar"),
        (["run", "allocator", "--policy", "no-such-policy"], {}, "unknown policy 'no-such-policy'"),
        (["up", "--policy", "no-such-policy"], {}, "unknown policy 'no-such-policy'"),
        (["up", "--nodes", "-1"], {}, "--nodes must be >= 0"),
        (["up"], {"SHOAL_PLACER": "random"}, "unknown placer 'random'"),
    ],
)
def test_run_bad_configuration_fails_before_doing_anything(
    argv: list[str], env: dict[str, str], needle: str
) -> None:
    proc = shoal(*argv, env={"SHOAL_NATS_URL": "nats://127.0.0.1:1", **env})
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_without_a_server_says_how_to_get_one(tmp_path: Path) -> None:
    proc = shoal("run", "admission", env={"SHOAL_STATE_DIR": str(tmp_path), "SHOAL_POLCY": "srtf"})
    assert proc.returncode == 2
    assert "no NATS server: set NATS_URL or run `shoal up`" in proc.stderr
    # A misspelt setting is pointed out, not silently ignored.
    assert "unknown setting SHOAL_POLCY (did you mean SHOAL_POLICY?) is ignored" in proc.stderr
    proc = shoal("run", "placer", env={"NATS_URL": "nats://127.0.0.1:1"})
    assert proc.returncode == 2
    assert "no NATS server reachable at nats://127.0.0.1:1" in proc.stderr


def test_node_daemon_without_gpus_asks_for_fake_ones() -> None:
    from shoal.gpus import discover_nvml

    if discover_nvml():
        pytest.skip("this machine has NVML GPUs")
    proc = shoal("run", "node-daemon", env={"SHOAL_NATS_URL": "nats://127.0.0.1:1"})
    assert proc.returncode == 2
    assert "no GPUs found through NVML" in proc.stderr and "--fake-gpus" in proc.stderr


def test_schemas_check_passes_on_the_committed_tree() -> None:
    proc = shoal("schemas", "check")
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout


def test_schemas_check_lists_stale_files(tmp_path: Path) -> None:
    target = tmp_path / "schemas"
    assert shoal("schemas", "export", "--dir", str(target)).returncode == 0
    (target / "Envelope.json").write_text("{}\n")
    proc = shoal("schemas", "check", "--dir", str(target))
    assert proc.returncode == 1
    assert "Envelope.json" in proc.stderr and "JobSpec.json" not in proc.stderr


def test_a_reader_that_goes_away_is_not_an_error(tmp_path: Path) -> None:
    """`shoal native status | head -0`: the pipe is closed before the command writes; the
    command ends quietly with 0 instead of a BrokenPipeError traceback."""
    env = {**os.environ, "SHOAL_NATIVE_DIR": str(tmp_path / "none")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "native", "status"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err

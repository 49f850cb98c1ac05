"""What the node daemon starts for a job: emulated sidecars by default, real ones on request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.gpus import fake_gpus
from shoal.settings import Settings, SettingsError
from shoal_services.node_daemon.main import sidecar_argv
from shoal_services.trainer_sidecar.real import parse_devices


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_default_is_the_emulated_sidecar(tmp_path: Path) -> None:
    settings = Settings.load(env={}, state_dir=str(tmp_path))
    argv = list(sidecar_argv("n0", settings, fake_gpus(4, "V100"), True, "nats://h:1")("j1"))
    assert argv == [
        sys.executable,
        "-m",
        "shoal_services.trainer_sidecar.main",
        "--job",
        "j1",
        "--node",
        "n0",
        "--gpu-type",
        "V100",  # the emulated speed is this generation's
    ]


def test_real_mode_on_fake_gpus_runs_one_cpu_slot_per_gpu(tmp_path: Path) -> None:
    settings = Settings.load(env={"SHOAL_SIDECAR_MODE": "real"}, state_dir=str(tmp_path), prefix="px")
    argv = list(sidecar_argv("n0", settings, fake_gpus(3, "T4"), True, "nats://h:1")("j1"))
    assert argv[:5] == [sys.executable, "-m", "shoal_services.trainer_sidecar", "--mode", "real"]
    assert (flag(argv, "--job"), flag(argv, "--node")) == ("j1", "n0")
    assert (flag(argv, "--nats-url"), flag(argv, "--prefix")) == ("nats://h:1", "px")
    assert (flag(argv, "--device"), flag(argv, "--gpu-type")) == ("cpu", "T4")
    assert parse_devices(flag(argv, "--devices")) == (0, 1, 2)
    assert flag(argv, "--workdir") == str(tmp_path / "train")
    # Workers of a job spanning nodes reach its leading sidecar here: same machine by default.
    assert flag(argv, "--advertise-host") == "127.0.0.1"


def test_real_mode_advertises_the_configured_sidecar_host(tmp_path: Path) -> None:
    env = {"SHOAL_SIDECAR_MODE": "real", "SHOAL_SIDECAR_HOST": "10.0.0.7"}
    settings = Settings.load(env=env, state_dir=str(tmp_path))
    argv = list(sidecar_argv("n0", settings, fake_gpus(1), True, "nats://h:1")("j1"))
    assert flag(argv, "--advertise-host") == "10.0.0.7"
    with pytest.raises(SettingsError, match="SHOAL_SIDECAR_HOST"):
        Settings.load(env={"SHOAL_SIDECAR_HOST": "a b"}, state_dir=str(tmp_path))


@pytest.mark.parametrize(("indices", "expected"), [((2,), (2,)), ((0, 1, 3), (0, 1, 3))])
def test_real_mode_on_nvml_gpus_names_the_cuda_indices(
    tmp_path: Path, indices: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    gpus = tuple(ev.GpuInfo(index=i, gpu_type="A100") for i in indices)
    settings = Settings.load(env={"SHOAL_SIDECAR_MODE": "real"}, state_dir=str(tmp_path))
    argv = list(sidecar_argv("n0", settings, gpus, False, "nats://h:1")("j1"))
    assert flag(argv, "--device") == "cuda"
    # A single index must not read as a count of slots.
    assert parse_devices(flag(argv, "--devices")) == expected


def test_bad_mode_is_a_clear_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="SHOAL_SIDECAR_MODE"):
        Settings.load(env={"SHOAL_SIDECAR_MODE": "fake"}, state_dir=str(tmp_path))

"""The ``shoal-train`` image (deploy/compose/Dockerfile, target ``shoal-train``): the node
daemon's image in real mode on Kubernetes (deploy/k8s/node-daemon/daemonset.yaml), built
the way an operator builds it (``deploy/compose/build.sh shoal-train``, offline from the
wheelhouse) and run with the DaemonSet's restrictions: not root, a read-only root file
system with a memory-backed ``/tmp`` and ``/dev/shm``, every capability dropped, no
privilege escalation. In it, torch trains the shipped example (``examples/cnn_digits.py``,
mounted read-only: the image ships shoal, not the users' scripts) on CPU, and shoal's
real-mode pieces (the trainer sidecar, the node daemon with NVML) load.

Marker ``container`` (``.ci/run``'s container step), like tests/deploy/test_compose.py:
skipped without podman or the base image, except under CI (``CI`` set), where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import BASE_IMAGE, unavailable

pytestmark = [pytest.mark.container, pytest.mark.integration, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/shoal-train:0.1.0"


@pytest.fixture(scope="module")
def train_image() -> str:
    if shutil.which("podman") is None:
        unavailable("podman is not installed")
    podman = ["podman", "--runtime", "runc"]
    if subprocess.run([*podman, "image", "exists", BASE_IMAGE], check=False).returncode != 0:
        unavailable(f"no base image {BASE_IMAGE} (.ci/run makes it with debootstrap)")
    build = subprocess.run(
        [str(ROOT / "deploy" / "compose" / "build.sh"), "shoal-train"],
        env={**os.environ, "BASE": BASE_IMAGE, "PYTHON": sys.executable},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, (
        f"build.sh shoal-train failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    )
    return IMAGE


def _run(image: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` in the image as the DaemonSet runs its container (securityContext and
    volumes of deploy/k8s/node-daemon/daemonset.yaml), through the image's tini."""
    return subprocess.run(
        [
            "podman",
            "--runtime",
            "runc",
            "run",
            "--rm",
            "--read-only",
            "--tmpfs",
            "/tmp",
            "--shm-size",
            "256m",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "--network",
            "none",
            "-v",
            f"{ROOT / 'examples'}:/examples:ro",
            "--entrypoint",
            "/usr/bin/tini",
            image,
            "--",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_train_image_trains_the_example_unprivileged_on_a_read_only_root(train_image: str) -> None:
    who = _run(train_image, "id", "-u")
    assert who.returncode == 0 and who.stdout.strip() == "10001", who.stderr
    out = _run(train_image, "python", "/examples/cnn_digits.py", "--max-steps", "30")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step 20 ") and lines[-1].startswith("done step 30 loss "), lines[-5:]
    at_20, at_30 = float(lines[0].split("loss ")[1]), float(lines[-1].split("loss ")[1])
    assert at_30 < at_20 < 2.31, "the loss went down from ln(10) (chance on ten digits): it trained"


def test_the_train_image_has_the_real_mode_pieces(train_image: str) -> None:
    """What a real-mode node daemon starts is there: torch (CPU build here), the trainer
    sidecar's entry point, and NVML, which with no driver reports no GPUs instead of
    failing (shoal.gpus)."""
    probe = (
        "import torch, pynvml, shoal_services.trainer_sidecar.real, shoal.train.runtime;"
        "from shoal.gpus import discover_nvml;"
        "print(torch.__version__, len(discover_nvml()))"
    )
    out = _run(train_image, "python", "-c", probe)
    assert out.returncode == 0, out.stderr[-3000:]
    version, gpus = out.stdout.split()
    assert version.startswith("2.") and gpus == "0"
    help_ = _run(train_image, "shoal", "run", "node-daemon", "--help")
    assert help_.returncode == 0 and "--fake-gpus" in help_.stdout, help_.stderr[-2000:]

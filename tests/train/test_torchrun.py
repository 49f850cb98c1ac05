"""A script that uses ``shoal.train`` runs unchanged without shoal: under torchrun or alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.train.conftest import CNN

pytestmark = pytest.mark.integration


def _run(argv: list[str], tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_TRAIN_")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_runs_unchanged_under_torchrun_and_alone(tmp_path) -> None:
    args = [str(CNN), "--max-steps", "30", "--float64"]
    alone = _run([sys.executable, *args], tmp_path)
    ranked = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        tmp_path,
    )
    done = re.findall(r"done step (\d+) loss ([0-9.]+)", alone)
    assert done and done[0][0] == "30"
    # Two ranks on half-batches each compute the same updates as one process.
    assert re.findall(r"done step (\d+) loss ([0-9.]+)", ranked) == done
    assert "world 2" in ranked and "world 1" in alone


def test_transformer_example_learns_the_markov_chain(tmp_path) -> None:
    lm = CNN.parent / "transformer_lm.py"
    out = _run([sys.executable, str(lm), "--max-steps", "60", "--time-after", "5"], tmp_path)
    loss = float(re.findall(r"done step 60 loss ([0-9.]+)", out)[0])
    assert loss < 3.0, f"loss {loss} should fall well below ln(64) = 4.16"


def test_the_plain_ddp_baseline_trains_the_same_model(tmp_path) -> None:
    """``--plain-ddp`` (the overhead baseline of bench_reconfig.py and bench_gpu.py) and
    ``shoal.train`` under torchrun take the same steps: same model, data, batches and
    optimizer, so their speeds compare like for like (one rank: its loss is the global one)."""
    lm = CNN.parent / "transformer_lm.py"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(lm)]
    args = ["--max-steps", "40", "--time-after", "5"]
    plain = _run([*run, *args, "--plain-ddp"], tmp_path)
    shoal = _run([*run, *args], tmp_path)
    loss = {
        name: float(re.findall(r"done step 40 loss ([0-9.]+)", out)[0])
        for name, out in (("plain", plain), ("shoal", shoal))
    }
    assert loss["plain"] < 3.5, loss  # it learned: ln(64) = 4.16 at the start
    assert abs(loss["plain"] - loss["shoal"]) < 1e-3, loss

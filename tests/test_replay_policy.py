"""benchmarks/replay_policy.py: a recording replays to exactly the decisions the simulation made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "replay_policy.py"
replay = load_script(SCRIPT, "replay_policy")


def _replayed_digest(path: Path, policy: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'libs'}{os.pathsep}{ROOT / 'benchmarks'}")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--child", str(path), policy, "1", "digest"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return str(json.loads(proc.stdout.strip().splitlines()[-1])["digest"])


def test_a_gandiva_fair_recording_replays_to_the_simulations_decisions(tmp_path: Path) -> None:
    path = tmp_path / "rec.pkl"
    info = replay.record("philly:2869ce:30", "topology", "gandiva-fair", 1, 400, path)
    assert info["recorded"] == info["decisions_seen"] == 400
    assert _replayed_digest(path, "gandiva-fair") == info["live_digest"]


def test_another_policy_on_the_same_inputs_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "rec.pkl"
    info = replay.record("philly:2869ce:30", "topology", "gandiva-fair", 2, 200, path)
    assert info["recorded"] == 100
    # FIFO answers the same views with other shares and no memory: another digest.
    assert _replayed_digest(path, "fifo") != info["live_digest"]

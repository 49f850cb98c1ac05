"""benchmarks/replay_policy.py: a recording replays to exactly the decisions the simulation made."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "replay_policy.py"
replay = load_script(SCRIPT, "replay_policy")


def _replayed_digest(path: Path, policy: str, *step: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'libs'}{os.pathsep}{ROOT / 'benchmarks'}")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--child", str(path), policy, "1", "digest", *step],
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


def test_a_placement_recording_replays_to_the_simulations_placements(tmp_path: Path) -> None:
    """``--step placement``: the placement step replayed on its recorded inputs places as the
    simulation did (node hints and slots included), and the same inputs with every hint
    moved to the next server place otherwise."""
    import msgspec

    path = tmp_path / "rec.pkl"
    info = replay.record("philly:2869ce:30", "topology", "gandiva-fair", 1, 300, path, "placement")
    assert info["recorded"] == info["decisions_seen"] == 300
    assert _replayed_digest(path, "gandiva-fair", "placement") == info["live_digest"]

    with path.open("rb") as f:
        inputs = pickle.load(f)
    assert any(s.policy_memory.get("node_hints") for _, s, _, _ in inputs)

    # Every hint moved to the next server: the hinted placer puts the jobs there.
    def moved(names: list[str], servers: int) -> list[str]:
        out = []
        for name in names:
            gen, _, i = name.rpartition("#")
            out.append(f"{gen}#{(int(i) + 1) % servers}")
        return out

    hinted = [(t, s, p, pl) for t, s, p, pl in inputs if s.policy_memory.get("node_hints")]
    moved_hints = [
        (
            t,
            msgspec.structs.replace(
                s,
                policy_memory={
                    **s.policy_memory,
                    "node_hints": {
                        j: moved(n, len(t.nodes)) for j, n in s.policy_memory["node_hints"].items()
                    },
                },
            ),
            p,
            pl,
        )
        for t, s, p, pl in hinted
    ]
    digests = []
    for name, rec in (("hinted", hinted), ("moved", moved_hints)):
        with (tmp_path / f"{name}.pkl").open("wb") as f:
            pickle.dump(rec, f)
        digests.append(_replayed_digest(tmp_path / f"{name}.pkl", "gandiva-fair", "placement"))
    assert digests[0] != digests[1]


def test_a_policy_bound_to_the_simulators_costs_replays_bound_to_them(tmp_path: Path) -> None:
    """SideCar predicts with the costs the simulator binds it to (a flat pool: ``free``, not
    its own default): the recording keeps them, and the replay's fresh policy is bound alike."""
    path = tmp_path / "rec.pkl"
    # (On this prefix SideCar bound to its own default costs decides otherwise.)
    info = replay.record("philly:0e4a51:100", "flat", "sidecar", 1, 300, path)
    assert info["recorded"] == info["decisions_seen"] > 150
    with path.open("rb") as f:
        assert pickle.load(f)["costs"]["name"] == "free"
    assert _replayed_digest(path, "sidecar") == info["live_digest"]

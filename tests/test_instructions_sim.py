"""benchmarks/instructions_sim.py: its cells are checked before anything runs, and (with
valgrind, slow) a tree against itself executes the same instructions for the same result."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "instructions_sim.py"
instructions = load_script(SCRIPT, "instructions_sim")


@pytest.mark.parametrize("cell", ["2869ce:srtf:flat", "2869ce:srtf:nodes:10", "2869ce:srtf:flat:ten"])
def test_a_malformed_cell_is_refused_before_anything_runs(
    cell: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        instructions.main(["--baseline-ref", "HEAD", "--cells", cell, "--out", str(tmp_path / "r.md")])
    assert exc.value.code == 2
    assert "VC:POLICY:SETTING:JOBS" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_head_against_itself_counts_the_same_instructions(tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    assert (
        instructions.main(["--baseline-ref", "HEAD", "--cells", "2869ce:fifo:flat:8", "--out", str(out)]) == 0
    )
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 2869ce:fifo:flat:8"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[-1] == "yes"
    base, new = (float(c.removesuffix(" G")) for c in cols[2:4])
    assert new > 0 and abs(base / new - 1) < 0.01

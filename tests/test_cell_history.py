"""benchmarks/cell_history.py: one reproduction cell computed at several git refs, each
in a temporary worktree of its own, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cell_history.py"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def _history(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/cell_history.py ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.skipif(_git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")
def test_the_same_cell_at_two_refs_of_the_same_commit_is_identical_and_worktrees_go(tmp_path: Path) -> None:
    before = _git("worktree", "list").stdout
    temps = set(Path(tempfile.gettempdir()).glob("cell-history-*"))
    out = tmp_path / "history.md"
    cell = ("--setting", "flat", "--vc", "e13805", "--policy", "afs-p", "--limit", "20")
    proc = _history(*cell, "--workers", "2", "HEAD", "HEAD", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| HEAD |")]
    assert len(rows) == 2
    assert all("| +0.00% |" in row for row in rows), rows
    jct = {row.split("|")[3] for row in rows}
    assert len(jct) == 1 and jct.pop().strip()  # one average, and not empty
    assert _git("worktree", "list").stdout == before  # the temporary worktrees were removed ...
    assert set(Path(tempfile.gettempdir()).glob("cell-history-*")) == temps  # ... with their folders


@pytest.mark.skipif(_git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")
def test_a_ref_that_does_not_exist_is_refused_by_name() -> None:
    proc = _history("--setting", "flat", "--vc", "e13805", "--policy", "srtf", "no-such-ref-x", timeout=120)
    assert proc.returncode != 0
    assert "'no-such-ref-x' is not a commit" in proc.stderr
    assert "Traceback" not in proc.stderr

"""benchmarks/decision_churn.py: its per-decision counts agree with the run's own log."""

from __future__ import annotations

from pathlib import Path

from shoal import events as ev

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decision_churn.py"
churn = load_script(SCRIPT, "decision_churn")


def test_the_counts_are_the_changes_between_the_logged_decisions(tmp_path: Path) -> None:
    """Every decision that changes a share is a SharesDecided in the log, and the shares
    changed it counts are the difference between consecutive logged decisions; one that
    changes none publishes nothing (or only new memory)."""
    row = churn.measure("philly:2869ce:120:afs-p:topology", retain_log=True)
    assert row["decisions"] == row["simulator_decisions"] > 0
    logged = [e.event.shares for e in row["log"] if isinstance(e.event, ev.SharesDecided)]
    last: dict[str, int] = {}
    expected = []
    for shares in logged:
        changed = sum(1 for j, n in shares.items() if last.get(j) != n) + sum(
            1 for j in last if j not in shares
        )
        last = shares
        expected.append(changed)
    counted = row["changed"]
    assert [c for c in counted if c] == [c for c in expected if c]
    assert sum(counted) == sum(expected) > 0
    assert 0.0 <= row["unchanged_share"] <= 1.0 and row["held_mean"] > 0
    assert row["events"] == len(row["log"]) and row["fold_cpu_s"] is not None


def test_the_report_is_written_with_the_command_that_made_it(tmp_path: Path) -> None:
    out = tmp_path / "churn.md"
    assert churn.main(["--run", "philly:2869ce:60:srtf:flat", "--out", str(out)]) == 0
    text = out.read_text()
    assert "`python benchmarks/decision_churn.py --run philly:2869ce:60:srtf:flat --out " in text
    assert "| philly:2869ce:60:srtf:flat | 60 |" in text

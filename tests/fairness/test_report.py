"""The heterogeneity report's command runs end to end (small workloads).

The default run generates a reduced report (``--jobs-per-user 10 --days 0.05``, one
seed: about 25 s of CPU); the ``--quick`` report is marked ``slow``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fairness_heterogeneity.py"
POLICIES = {
    "gandiva-fair",
    "gandiva-fair (no trading)",
    "gandiva-fair (spill)",
    "afs-p",
    "max-min",
    "afs-het",
}
FIGURES = ("s55_rate.png", "s55_share.png", "philly_fairness_vs_jct.png", "philly_shortfall.png")


def _load() -> ModuleType:
    return load_script(SCRIPT, "fairness_heterogeneity")


def _generate(tmp_path: Path, options: list[str]) -> tuple[str, dict, Path]:
    out, figures = tmp_path / "report.md", tmp_path / "figures"
    assert _load().main([*options, "--out", str(out), "--figures", str(figures)]) == 0
    return out.read_text(), json.loads((figures / "results.json").read_text()), figures


def _check(text: str, data: dict, figures: Path, command: str) -> None:
    for heading in ("## 1. Gandiva_fair §5.5", "## 2. Distance from fair share", "## 3. Fairness vs JCT"):
        assert heading in text
    assert f"`{command}`" in text
    assert "Why U1 gains" in text
    assert set(data["philly"]) == POLICIES
    assert all(data["philly"][p][0]["avg_jct_h"] > 0 for p in data["philly"])
    for source in ("gavel", "table1"):
        s55 = data["section55"][source]
        assert len(s55["trade_log"]) == s55["trades_executed"]
        users = s55["explanation"]["users"]
        assert set(users) == {"U1", "U2", "U3", "U4"}
        assert all(u["total_work_k80_h"] > 0 for u in users.values())
    for name in FIGURES:
        assert (figures / name).stat().st_size > 0


def test_reduced_report_is_generated_with_every_section(tmp_path: Path) -> None:
    options = ["--quick", "--seeds", "0", "--jobs-per-user", "10", "--days", "0.05"]
    text, data, figures = _generate(tmp_path, options)
    _check(
        text,
        data,
        figures,
        "python benchmarks/fairness_heterogeneity.py --quick --seeds 0 --jobs-per-user 10 --days 0.05",
    )
    assert "4 users × 10 jobs" in text


@pytest.mark.slow
def test_quick_report_is_generated_with_every_section(tmp_path: Path) -> None:
    text, data, figures = _generate(tmp_path, ["--quick", "--seeds", "0"])
    _check(text, data, figures, "python benchmarks/fairness_heterogeneity.py --quick --seeds 0")
    assert "4 users × 30 jobs" in text

"""The heterogeneity report's command runs end to end (small workloads)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fairness_heterogeneity.py"


@pytest.mark.slow
def test_quick_report_is_generated_with_every_section(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("fairness_heterogeneity", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, figures = tmp_path / "report.md", tmp_path / "figures"
    assert module.main(["--quick", "--seeds", "0", "--out", str(out), "--figures", str(figures)]) == 0
    text = out.read_text()
    for heading in ("## 1. Gandiva_fair §5.5", "## 2. Distance from fair share", "## 3. Fairness vs JCT"):
        assert heading in text
    assert "`python benchmarks/fairness_heterogeneity.py --quick --seeds 0`" in text
    data = json.loads((figures / "results.json").read_text())
    assert set(data["philly"]) == {
        "gandiva-fair",
        "gandiva-fair (no trading)",
        "gandiva-fair (spill)",
        "afs-p",
        "max-min",
        "afs-het",
    }
    assert all(data["philly"][p][0]["avg_jct_h"] > 0 for p in data["philly"])
    for name in ("s55_rate.png", "s55_share.png", "philly_fairness_vs_jct.png", "philly_shortfall.png"):
        assert (figures / name).stat().st_size > 0

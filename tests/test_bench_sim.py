"""benchmarks/bench_sim.py: how it judges issue 24's targets (the calibration against the
day of the issue's table, the medians of repeated runs, the report's verdicts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sim.py"
bench = load_script(SCRIPT, "bench_sim")


def _calib_cell(vc: str, policy: str, whole: float, status: str = "ok") -> dict[str, Any]:
    run = {
        "trace": f"philly:{vc}",
        "policy": policy,
        "setting": "flat",
        "status": status,
        "whole_cpu_s": whole,
    }
    return {"section": "calibrate", "runs": [run, dict(run, whole_cpu_s=whole / 2)]}


def _results(
    factor_by_cell: dict[tuple[str, str], float], sha: str = bench.ISSUE_TREE + "0" * 33
) -> dict[str, Any]:
    cells = [
        _calib_cell(vc, p, f * bench.ISSUE_SHOAL_CPU_S[(vc, p)]) for (vc, p), f in factor_by_cell.items()
    ]
    return {"trees": ["baseline", "new"], "cells": cells, "startup": {}, "repeat": 1, "baseline_sha": sha}


def test_the_factor_is_the_median_of_the_baselines_today_over_the_issues_figures() -> None:
    cal = bench.calibration(
        _results({("7f04ca", "afs-p"): 1.3, ("ee9e8c", "tiresias-l"): 0.9, ("b436b2", "afs-p"): 1.1})
    )
    assert cal is not None
    assert abs(cal["factor"] - 1.1) < 1e-12
    assert abs(cal["ratios"]["7f04ca afs-p"] - 1.3) < 1e-12


def test_no_factor_unless_the_baseline_is_the_issues_tree_and_a_cell_finished() -> None:
    assert bench.calibration(_results({("7f04ca", "afs-p"): 1.0}, sha="0123456789")) is None
    stopped = _results({})
    stopped["cells"] = [_calib_cell("7f04ca", "afs-p", 5.0, status="time limit")]
    assert bench.calibration(stopped) is None


def test_a_bound_shrinks_on_a_faster_day_and_never_grows_on_a_slower_one() -> None:
    assert bench.threshold(30.0, None) == 30.0
    assert bench.threshold(30.0, {"factor": 1.4}) == 30.0
    assert bench.threshold(30.0, {"factor": 0.8}) == 24.0


def test_medians_of_repeated_runs_keep_the_whole_process_figure_apart() -> None:
    runs = [
        {"status": "ok", "cpu_s": 3.0, "whole_cpu_s": 1.0},
        {"status": "ok", "cpu_s": 1.0, "whole_cpu_s": 9.0},
        {"status": "ok", "cpu_s": 2.0, "whole_cpu_s": 5.0},
    ]
    out = bench._median_run(runs)
    assert out["cpu_s"] == 2.0 and out["whole_cpu_s"] == 5.0
    assert out["whole_cpu_s_runs"] == [1.0, 9.0, 5.0]
    only_whole = [{"status": "ok", "whole_cpu_s": w} for w in (4.0, 2.0, 3.0)]
    assert bench._median_run(only_whole)["whole_cpu_s"] == 3.0


def test_the_flat_verdict_is_on_the_whole_process_at_the_slower_of_the_two_speeds() -> None:
    def flat(whole: float) -> dict[str, Any]:
        run = {"trace": "philly:2869ce", "policy": "afs-p", "setting": "flat", "status": "ok", "cpu_s": 0.1}
        return {
            "section": "flat",
            "runs": [dict(run, cpu_s=0.3, whole_cpu_s=1.0), dict(run, whole_cpu_s=whole)],
        }

    # The prototype's 0.95 s halved is 0.475 s; on a day 20 % faster than the issue's it is 0.38 s.
    fast_day = {("7f04ca", "afs-p"): 0.8}
    report = bench.render(
        {**_results(fast_day), "cells": [flat(0.40), *_results(fast_day)["cells"]]}, "cmd", [], "q.png"
    )
    assert "`--flat` 2869ce afs-p" in report
    line = next(x for x in report.splitlines() if x.startswith("- `--flat` 2869ce afs-p"))
    assert "MISSED" in line and "0.38 s" in line, line
    report = bench.render(
        {**_results(fast_day), "cells": [flat(0.30), *_results(fast_day)["cells"]]}, "cmd", [], "q.png"
    )
    line = next(x for x in report.splitlines() if x.startswith("- `--flat` 2869ce afs-p"))
    assert "met" in line, line
    # The simulation alone (0.1 s) is reported, never judged.
    report = bench.render({**_results({}), "cells": [flat(0.60)]}, "cmd", [], "q.png")
    line = next(x for x in report.splitlines() if x.startswith("- `--flat` 2869ce afs-p"))
    assert "MISSED" in line, line


class _FakeTree:
    """Hands out whole-process figures in turn, as :meth:`Tree.whole_cpu` would."""

    def __init__(self, *runs: tuple[float, str]) -> None:
        self.runs = list(runs)

    def whole_cpu(self, vc: str, policy: str, limit_s: float) -> dict[str, Any]:
        cpu, status = self.runs.pop(0)
        return {
            "trace": f"philly:{vc}",
            "policy": policy,
            "setting": "flat",
            "status": status,
            "whole_cpu_s": cpu,
        }


def test_a_whole_process_figure_is_the_median_of_three_and_a_stopped_one_is_kept() -> None:
    got = bench._whole(_FakeTree((0.9, "ok"), (0.3, "ok"), (0.4, "ok")), "2869ce", "srtf", 60)
    assert got["whole_cpu_s"] == 0.4 and got["whole_cpu_s_each"] == [0.9, 0.3, 0.4]
    stopped = bench._whole(_FakeTree((0.5, "ok"), (60.0, "time limit")), "2869ce", "srtf", 60)
    assert stopped["status"] == "time limit" and stopped["whole_cpu_s"] == 60.0
    assert stopped["whole_cpu_s_each"] == [0.5, 60.0]


def test_a_run_reports_the_policys_own_cpu_inside_the_runs() -> None:
    # A real (small) simulation: the policy's share is part of the run's CPU, not all of it.
    run = bench.run_cell("philly:2869ce:60", "afs-l", "topology", 60.0)
    assert run["status"] == "ok" and run["decisions"] > 0
    assert 0.0 < run["policy_cpu_s"] < run["cpu_s"]
    assert 0 < run["changing_decisions"] <= run["decisions"]


def test_only_decisions_that_change_the_shares_count_as_changing() -> None:
    from shoal.policies.base import Decision

    class Alternating:
        name = "stub"

        def __init__(self) -> None:
            self.calls = 0

        def decide(self, view: Any, memory: Any) -> Decision:
            self.calls += 1
            # a, a, b, b, a, a: three changes (the first against nothing).
            return Decision(shares={"a" if (self.calls - 1) % 4 < 2 else "b": 1})

    limited = bench._Limited(Alternating(), 60.0)
    for _ in range(6):
        limited.decide(None, {})
    assert limited.changing == 3


def test_the_split_says_when_only_the_engine_side_can_meet_a_target() -> None:
    def large(policy: str, setting: str, cpu: float, policy_cpu: float, status: str = "ok") -> dict[str, Any]:
        run = {
            "trace": bench.LARGE,
            "policy": policy,
            "setting": setting,
            "status": status,
            "cpu_s": cpu,
            "policy_cpu_s": policy_cpu,
            "completed": 10,
            "jobs": 20,
        }
        return {"section": "large", "runs": [dict(run, cpu_s=2 * cpu), run]}

    cells = [
        large("afs-p", "flat", 45.0, 20.0),  # the rest, 25 s, is under 30 s
        large("afs-p", "topology", 75.0, 20.0),  # the rest, 55 s, is over it
        large("afs-l", "flat", 25.0, 10.0),
        large("afs-l", "topology", 300.0, 100.0, status="CPU limit"),
    ]
    report = bench.render({**_results({}), "cells": cells}, "cmd", [], "q.png")
    assert "## Where the CPU goes in each target" in report
    rows = {x.split(" | ")[0]: x for x in report.splitlines() if x.startswith("| afs-")}
    assert "met if the policy cost at most 5.00 s (it costs 20.00 s)" in rows["| afs-p on 6214e9, flat"]
    assert "still MISSED: the rest alone is 1.8x the bound" in rows["| afs-p on 6214e9, topology"]
    assert "met already" in rows["| afs-l on 6214e9, flat"]
    assert "not known: stopped (CPU limit); the policy took 33%" in rows["| afs-l on 6214e9, topology"]
    # Runs recorded before the split existed leave the section out.
    for c in cells:
        for r in c["runs"]:
            del r["policy_cpu_s"]
    assert "Where the CPU goes" not in bench.render({**_results({}), "cells": cells}, "cmd", [], "q.png")

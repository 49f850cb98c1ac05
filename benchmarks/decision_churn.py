"""How much a decision changes: the measurement behind issue 24's next structural step.

Every decision of the simulator is a ``SharesDecided`` that names *every* share in
force, and the fold, the decision check, the engine's diffs and placement each pass over
all of them. Whether a decision that carries only what changed would pay off, and
whether the time-slicing policies (Gandiva_fair, Themis) are bounded by the number of
decisions rather than by their cost, depends on how many jobs a decision sees, how many
hold a share, and how many shares it changes. This script measures those per decision.

It runs the simulator as ``shoal simulate`` does (``load_workload``, ``make_policy``,
``Simulator``; seed 0, the log retained only with ``--fold``) with one instrument: the engine's
``decide_shares`` is wrapped, and each ``SharesDecided`` it returns is compared with the
previous one. Nothing else is changed; the wrapper adds its own cost to the CPU seconds,
which are given only to relate the counts to the run (``benchmarks/bench_sim.py`` is the
speed benchmark).

Per run it reports:

* decisions, and events folded per decision;
* jobs in the view (the active jobs the policy sees), mean and largest;
* jobs holding a share, mean;
* shares changed since the previous decision (a job whose count differs, given a share,
  or dropped), mean, 90th percentile and largest;
* the decisions that change no share at all;
* with ``--fold``: the events, and the CPU seconds of folding the whole log again.

Usage::

    python benchmarks/decision_churn.py        # writes benchmarks/reports/decision_churn.md
    python benchmarks/decision_churn.py --run philly:2869ce:200:afs-p:flat --out /tmp/churn.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_RUNS = (
    "philly:2869ce:afs-p:flat",
    "philly:6214e9:afs-p:flat",
    "philly:6214e9:afs-l:flat",
    "philly:2869ce:gandiva-fair:topology",
    "philly:2869ce:themis:topology",
)
"""``trace:vc:policy:setting``: the cells of issue 24's targets that are furthest from
them (AFS-P on the 51k-job VC; Gandiva_fair and Themis on the 956-job VC), and two for
comparison."""


class Churn:
    """Counts per decision, gathered by :meth:`wrap`."""

    def __init__(self) -> None:
        self.in_view: list[int] = []
        self.held: list[int] = []
        self.changed: list[int] = []
        self._last: dict[str, int] = {}

    def wrap(self, decide_shares: Callable[..., Any]) -> Callable[..., Any]:
        def counted(policy: Any, view: Any, *args: Any, **kwargs: Any) -> Any:
            decided = decide_shares(policy, view, *args, **kwargs)
            shares = decided.shares
            last = self._last
            changed = sum(1 for j, n in shares.items() if last.get(j) != n)
            changed += sum(1 for j in last if j not in shares)
            self.in_view.append(len(view.jobs))
            self.held.append(len(shares))
            self.changed.append(changed)
            self._last = dict(shares)
            return decided

        return counted


def measure(run: str, *, retain_log: bool = False) -> dict[str, Any]:
    """One run (``<trace>:<policy>:<setting>``, e.g. ``philly:2869ce:afs-p:flat`` or a
    slice, ``philly:2869ce:200:afs-p:flat``), its counts summarised; with
    ``retain_log`` the run's envelopes are returned too (``"log"``)."""
    import shoal.sim.engine as engine
    from shoal.sim.engine import SimConfig, Simulator, make_policy
    from shoal.workloads import load_workload

    trace, policy, setting = run.rsplit(":", 2)
    if setting not in ("flat", "topology"):
        raise SystemExit(f"{run}: the setting is flat or topology")
    churn = Churn()
    original = engine.decide_shares
    engine.decide_shares = churn.wrap(original)  # type: ignore[assignment]
    try:
        jobs = load_workload(trace, seed=0)
        sim = Simulator(
            jobs,
            make_policy(policy, seed=0),
            SimConfig(retain_log=retain_log, flat=setting == "flat"),
            trace=trace,
        )
        started = time.process_time()
        sim.run()
        cpu = time.process_time() - started
    finally:
        engine.decide_shares = original  # type: ignore[assignment]
    n = len(churn.changed)
    if n == 0:
        raise SystemExit(f"{run}: no decision was made")
    fold_cpu: float | None = None
    if retain_log:
        # The floor a fold per event sets: the whole log folded again from nothing (what a
        # service replaying it does), with nothing else running.
        from shoal.state import fold

        started = time.process_time()
        fold(sim.log.envelopes)
        fold_cpu = time.process_time() - started
    ordered = sorted(churn.changed)
    return {
        "run": run,
        "log": sim.log.envelopes if retain_log else None,
        "simulator_decisions": sim.decisions,
        "events": len(sim.log),
        "fold_cpu_s": fold_cpu,
        "changed": churn.changed,
        "jobs": len(jobs),
        "cpu_s": cpu,
        "decisions": n,
        "events_per_decision": len(sim.log) / n,
        "in_view_mean": statistics.fmean(churn.in_view),
        "in_view_max": max(churn.in_view),
        "held_mean": statistics.fmean(churn.held),
        "changed_mean": statistics.fmean(churn.changed),
        "changed_p90": ordered[min(n - 1, int(0.9 * n))],
        "changed_max": ordered[-1],
        "unchanged_share": sum(1 for c in churn.changed if c == 0) / n,
    }


def render(rows: list[dict[str, Any]], command: str) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Decision churn",
        "",
        f"Generated by `{command}` on {when}.",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}. Seed 0, log retained only with `--fold`; "
        "`flat` = `shoal simulate --flat`, `topology` = the default 16 x 4 servers. CPU s include the "
        "counting wrapper's own cost (the speed benchmark is `benchmarks/bench_sim.py`).",
        "",
        "A decision's `SharesDecided` names every share in force. Columns: jobs the policy sees "
        "(the view), jobs holding a share, shares changed since the previous decision (a count "
        "that differs, a share given or dropped), and the decisions that change none.",
        "",
        "| run | jobs | decisions | events / decision | jobs in view (mean / max) | holding a share (mean) "
        "| shares changed (mean / p90 / max) | decisions changing nothing | CPU s | events "
        "| the log folded again: CPU s (µs / event) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fold_cpu = r["fold_cpu_s"]
        folded = "" if fold_cpu is None else f"{fold_cpu:.2f} ({1e6 * fold_cpu / r['events']:.1f})"
        lines.append(
            f"| {r['run']} | {r['jobs']:,} | {r['decisions']:,} | {r['events_per_decision']:.2f} "
            f"| {r['in_view_mean']:.1f} / {r['in_view_max']:,} | {r['held_mean']:.1f} "
            f"| {r['changed_mean']:.2f} / {r['changed_p90']} / {r['changed_max']} "
            f"| {100 * r['unchanged_share']:.1f} % | {r['cpu_s']:.1f} | {r['events']:,} | {folded} |"
        )
    lines += [
        "",
        "Reading it: where the shares held are many times the shares changed, a decision that "
        "carried only its changes would take the passes over every held share out of the fold, "
        "the decision check and the engine's diffs. Where most decisions change shares (time "
        "slicing rotates gangs every quantum), each is a `SharesDecided` to fold, settle and place, "
        "so the number of decisions times the engine's cost per decision bounds the run from "
        "below, whatever the policy costs. The last column (with `--fold`: the run keeps its log, "
        "and its CPU s then include making the envelopes) is that bound's floor for the fold alone: "
        "the whole log folded again from an empty state, as a service replaying it would.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", help="philly:<vc>:<policy>:<flat|topology> (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/reports/decision_churn.md")
    parser.add_argument(
        "--fold",
        action="store_true",
        help="keep each run's log and time folding it again (memory: the whole log)",
    )
    args = parser.parse_args(argv)
    runs = args.run or list(DEFAULT_RUNS)
    rows = []
    for run in runs:
        row = measure(run, retain_log=args.fold)
        row["log"] = None  # (the envelopes are not kept past the measurement)
        print(
            f"{run}: {row['decisions']:,} decisions, {row['changed_mean']:.2f} changed of {row['held_mean']:.1f} held"
        )
        rows.append(row)
    command = "python benchmarks/decision_churn.py" + "".join(f" --run {r}" for r in (args.run or []))
    if args.fold:
        command += " --fold"
    if args.out != ROOT / "benchmarks/reports/decision_churn.md":
        command += f" --out {args.out}"
    args.out.write_text(render(rows, command))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

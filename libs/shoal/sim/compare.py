"""Compare policies over traces: tables and plots from a matrix of runs.

:func:`write_compare` turns :class:`~shoal.sim.matrix.RunOutcome` cells into
``report.md`` (average JCT per trace and policy, and each policy's JCT reduction
relative to a baseline, ``baseline avg JCT / policy avg JCT`` as in AFS Figure 5),
``results.json`` (every cell's summary, wall time and error), and the plots of
:mod:`shoal.sim.plots`: ``jct_reduction.png``, and per trace ``jct_cdf_<trace>.png``
and ``metrics_<trace>.png`` (QL/CE/BI over time, AFS Figure 2). With several seeds,
a cell's average JCT is the mean over seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from shoal.sim.matrix import RunOutcome
from shoal.sim.report import markdown_table


def token(trace: str) -> str:
    """A file-name-safe form of a trace spec."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in trace).strip("_")


def avg_jct_table(outcomes: Sequence[RunOutcome]) -> dict[str, dict[str, float]]:
    """trace -> policy label -> average JCT (mean over seeds; NaN when any seed failed)."""
    cells: dict[str, dict[str, list[float]]] = {}
    for o in outcomes:
        value = o.summary.get("avg_jct_s", math.nan) if o.ok else math.nan
        cells.setdefault(o.spec.trace, {}).setdefault(o.spec.name, []).append(value)
    return {
        trace: {p: (statistics.fmean(v) if all(x == x for x in v) else math.nan) for p, v in per.items()}
        for trace, per in cells.items()
    }


def reduction_table(avg: dict[str, dict[str, float]], baseline: str) -> dict[str, dict[str, float]]:
    """trace -> policy -> ``avg[baseline] / avg[policy]`` (NaN when either is missing)."""
    out: dict[str, dict[str, float]] = {}
    for trace, per in avg.items():
        base = per.get(baseline, math.nan)
        out[trace] = {p: (base / v if v and v == v and base == base else math.nan) for p, v in per.items()}
    return out


def _h(seconds: float) -> str:
    return "—" if seconds != seconds else f"{seconds / 3600:,.2f}"


def _x(ratio: float) -> str:
    return "—" if ratio != ratio else f"{ratio:.2f}×"


def markdown_report(outcomes: Sequence[RunOutcome], baseline: str) -> str:
    """Average JCT (hours) and reduction vs ``baseline`` per trace and policy, plus failures."""
    avg = avg_jct_table(outcomes)
    red = reduction_table(avg, baseline)
    policies: list[str] = []
    for o in outcomes:
        if o.spec.name not in policies:
            policies.append(o.spec.name)
    traces = list(avg)
    parts = [
        "Average JCT (hours):",
        "",
        markdown_table(
            ["trace", *policies], [[t, *(_h(avg[t].get(p, math.nan)) for p in policies)] for t in traces]
        ),
        "",
        f"JCT reduction relative to {baseline} (its average JCT / the policy's; > 1 is better):",
        "",
        markdown_table(
            ["trace", *[p for p in policies if p != baseline]],
            [[t, *(_x(red[t].get(p, math.nan)) for p in policies if p != baseline)] for t in traces],
        ),
    ]
    failed = [o for o in outcomes if not o.ok]
    if failed:
        parts += ["", "Cells without a result:", ""]
        for o in failed:
            detail = o.error.splitlines()[0] if o.error else "no result"
            parts.append(
                f"- {o.spec.trace} × {o.spec.name} (seed {o.spec.seed}): {detail}; "
                f"{o.completed}/{o.jobs} jobs done, virtual time {o.virtual_s / 86400:.1f} days, "
                f"{o.cpu_s:.0f} CPU s ({o.wall_s:.0f} s wall)"
            )
    return "\n".join(parts)


def outcome_json(o: RunOutcome) -> dict[str, Any]:
    """One cell for ``results.json`` (without the per-job JCTs and series)."""
    doc = msgspec.to_builtins(o)
    doc.pop("jcts", None)
    doc.pop("series", None)
    doc["summary"] = {k: (None if v != v else v) for k, v in o.summary.items()}
    return doc


def write_compare(
    outcomes: Sequence[RunOutcome], baseline: str, out_dir: Path, *, plots: bool = True, title: str = ""
) -> str:
    """Write ``report.md``, ``results.json`` and the plots; return the markdown.

    Args:
        outcomes: the matrix cells.
        baseline: the policy label JCT reductions are relative to.
        out_dir: where to write (created).
        plots: also write the PNGs.
        title: heading of ``report.md``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown_report(outcomes, baseline)
    (out_dir / "report.md").write_text((f"# {title}\n\n" if title else "") + text + "\n")
    (out_dir / "results.json").write_bytes(
        msgspec.json.format(msgspec.json.encode([outcome_json(o) for o in outcomes]))
    )
    if plots:
        write_plots(outcomes, baseline, out_dir)
    return text


def write_plots(outcomes: Sequence[RunOutcome], baseline: str, out_dir: Path) -> list[Path]:
    """The Figure 5-, CDF- and Figure 2-style plots (first seed of each cell for CDFs/series)."""
    from shoal.sim.plots import plot_jct_cdfs, plot_jct_reduction, plot_metrics_over_time

    avg = avg_jct_table(outcomes)
    paths = [plot_jct_reduction(avg, baseline, out_dir / "jct_reduction.png")]
    by_trace: dict[str, dict[str, RunOutcome]] = {}
    for o in outcomes:
        if o.ok:
            by_trace.setdefault(o.spec.trace, {}).setdefault(o.spec.name, o)
    for trace, per in by_trace.items():
        paths.append(
            plot_jct_cdfs(
                {p: o.jcts for p, o in per.items()}, out_dir / f"jct_cdf_{token(trace)}.png", title=trace
            )
        )
        paths.append(
            plot_metrics_over_time(
                {p: o.series for p, o in per.items()}, out_dir / f"metrics_{token(trace)}.png", title=trace
            )
        )
    return paths

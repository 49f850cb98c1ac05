"""Plain-data views of a simulation result: ``results.json`` and text/markdown tables.

``results.json`` (written by ``shoal simulate --output DIR``) holds:

* ``policy``, ``trace``, ``seed``, ``config`` (the :class:`~shoal.sim.engine.SimConfig`);
* ``summary``: every scalar of :attr:`SimResult.summary`, among them ``avg_jct_s``,
  ``median_jct_s``, ``p99_jct_s``, ``makespan_s``, ``reconfigurations``, ``avg_ql``,
  ``avg_ce``, ``avg_bi`` (NaN, e.g. no job completed, is written as ``null``);
* ``series``: QL, CE, BI and GPUs in use at up to ``points`` evenly spaced times
  between the first arrival and the last completion (values at those instants, BI
  exact, see :mod:`shoal.sim.metrics`), plus ``samples``: how many decision samples
  the run had;
* ``user_shares``: GPU-seconds per user per GPU generation over the run and cumulative
  at the same times (Gandiva_fair-style fairness);
* ``jobs``: per job ``job_id``, ``user``, ``model``, ``requested_gpus``, ``arrival_s``,
  ``completion_s``, ``jct_s``, ``duration_s``, ``wait_s``, ``reconfigurations``
  (left out with ``jobs=False``);
* ``event_counts`` and ``final_digest`` (the digest of the folded state).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from shoal.sim.engine import SimResult

#: Summary keys shown in the CLI table, with their labels and units.
TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("jobs", "jobs", ""),
    ("completed", "completed", ""),
    ("avg_jct_s", "average JCT", "h"),
    ("median_jct_s", "median JCT", "h"),
    ("p99_jct_s", "p99 JCT", "h"),
    ("makespan_s", "makespan", "h"),
    ("avg_ql", "avg QL", ""),
    ("avg_ce", "avg CE", ""),
    ("avg_bi", "avg BI", ""),
    ("gpu_utilisation", "GPU utilisation", ""),
    ("reconfigurations", "reconfigurations", ""),
    ("preemptions", "preemptions", ""),
    ("migrations", "migrations", ""),
    ("lost_gpu_s", "GPU time lost to stops", "h"),
    ("decisions", "decisions", ""),
)


def _finite(value: float) -> float | None:
    return None if isinstance(value, float) and math.isnan(value) else value


def result_to_json(
    result: SimResult, *, seed: int | None = None, points: int = 1000, jobs: bool = True
) -> dict[str, Any]:
    """The ``results.json`` document of one run (see the module docstring).

    Args:
        result: the run.
        seed: the workload/policy seed, recorded for reproduction.
        points: how many times the series are given at.
        jobs: include the per-job outcomes.
    """
    outcomes = result.jobs
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.completion_s for o in outcomes if o.completion_s is not None), default=start)
    series = result.series.resampled(points, start, end)
    series["samples"] = [float(len(result.series.t))]
    doc: dict[str, Any] = {
        "policy": result.policy,
        "trace": result.trace,
        "seed": seed,
        "config": msgspec.to_builtins(result.config),
        "summary": {k: _finite(v) for k, v in result.summary.items()},
        "series": series,
        "event_counts": dict(sorted(result.event_counts.items())),
        "final_digest": result.final_digest,
    }
    if result.user_shares is not None:
        doc["user_shares"] = {
            "gpu_s": result.user_shares.gpu_seconds(start, end),
            "cumulative": result.user_shares.cumulative(min(points, 200), start, end),
        }
    if jobs:
        doc["jobs"] = [msgspec.to_builtins(o) for o in outcomes]
    return doc


def jcts(result: SimResult) -> list[float]:
    """Completed jobs' JCTs in seconds, sorted (for CDFs)."""
    return sorted(o.jct_s for o in result.jobs if o.jct_s is not None)


def _fmt(value: float | None, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "h":
        return f"{value / 3600:,.2f} h"
    if float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.4g}"


def summary_table(summary: Mapping[str, float | None], *, title: str = "") -> str:
    """An aligned two-column text table of the main metrics."""
    rows = [(label, _fmt(summary[key], unit)) for key, label, unit in TABLE_ROWS if key in summary]
    width = max((len(label) for label, _ in rows), default=0)
    lines = [title] if title else []
    lines += [f"  {label:<{width}}  {value:>16}" for label, value in rows]
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; the first column left-aligned, the rest right."""
    head = "| " + " | ".join(header) + " |"
    rule = "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"
    body = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])

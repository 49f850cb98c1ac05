"""Calibrate the ``measured`` reconfiguration costs from ``benchmarks/bench_reconfig.py``'s report.

Pure: :func:`parse_records` reads the report's "Raw records" table (one row per
reconfiguration the real trainer made), :func:`fit` turns them into the parameters of
:class:`shoal.sim.costs.ReconfigCosts`. ``python benchmarks/calibrate_costs.py`` writes
the result, with the report's first line and digest as provenance, to
``libs/shoal/data/reconfig_costs.json``, which :func:`shoal.sim.costs.measured` loads.

Fits (every sample is kept in the data file):

* ``scale_out_s``: mean stop of the in-place scale-outs (the switch).
* ``scale_in_s``: mean stop of the graceful scale-ins.
* ``prepare_s + prepare_per_gpu_s × new``: least squares over the in-place scale-outs of
  the order → switch time (the ``prepare`` and ``switch`` phases), the time the new
  workers hold GPUs without training.
* ``restart_s + restart_per_gpu_s × new``: least squares over the checkpoint-restarts'
  stop times (checkpoint, stop, start, restore), against the new GPU count.
* ``first_start_s``: mean stop of the first starts (recorded; a trace's run time already
  includes it, so the ``measured`` preset does not charge it).
"""

from __future__ import annotations

import re
from typing import Any

_ROW = re.compile(
    r"^\|\s*(?P<run>in place|restart)\s*\|\s*(?P<epoch>\d+)\s*\|\s*(?P<kind>\w+)\s*\|\s*(?P<old>\d+)\s*→\s*(?P<new>\d+)\s*"
    r"\|\s*(?P<outcome>\w+)\s*\|\s*(?P<stop>[0-9.]+)\s*\|\s*(?P<lost>[0-9.]+)\s*\|\s*(?P<phases>[^|]*)\|\s*$"
)


def parse_records(report: str) -> list[dict[str, Any]]:
    """The completed reconfigurations of the report's "Raw records" table.

    Raises:
        ValueError: the report has no raw records.
    """
    out: list[dict[str, Any]] = []
    _, _, raw = report.partition("## Raw records")
    for line in raw.splitlines():
        m = _ROW.match(line.strip())
        if m is None or m["outcome"] != "completed":
            continue
        phases: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in m["phases"].split(","))):
            name, _, value = part.rpartition(" ")
            phases[name] = float(value)
        out.append(
            {
                "run": m["run"],
                "kind": m["kind"],
                "from": int(m["old"]),
                "to": int(m["new"]),
                "stop_s": float(m["stop"]) / 1000.0,
                "lost_gpu_s": float(m["lost"]),
                "phases": phases,
            }
        )
    if not out:
        raise ValueError("no completed reconfiguration in the report's raw records")
    return out


def _mean(xs: list[float]) -> float:
    if not xs:
        raise ValueError("no sample")
    return sum(xs) / len(xs)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b·x``; the mean when x does not vary."""
    if not points:
        raise ValueError("no sample")
    mx = _mean([x for x, _ in points])
    my = _mean([y for _, y in points])
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def fit(records: list[dict[str, Any]]) -> dict[str, float]:
    """The ``measured`` model's parameters (see the module docstring).

    Raises:
        ValueError: a kind the model needs has no sample.
    """
    inplace = [r for r in records if r["run"] == "in place"]
    outs = [r for r in inplace if r["kind"] == "scale_out"]
    ins = [r for r in inplace if r["kind"] == "scale_in"]
    restarts = [r for r in records if r["kind"] == "restart"]
    starts = [r for r in records if r["kind"] == "start"]
    prep_a, prep_b = _line(
        [(r["to"], r["phases"].get("prepare", 0.0) + r["phases"].get("switch", 0.0)) for r in outs]
    )
    rs_a, rs_b = _line([(r["to"], r["stop_s"]) for r in restarts])
    return {
        "scale_out_s": _mean([r["stop_s"] for r in outs]),
        "scale_in_s": _mean([r["stop_s"] for r in ins]),
        "prepare_s": prep_a,
        "prepare_per_gpu_s": prep_b,
        "restart_s": rs_a,
        "restart_per_gpu_s": rs_b,
        "first_start_s": _mean([r["stop_s"] for r in starts]),
    }

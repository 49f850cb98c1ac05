"""Simulation metrics: JCT statistics and AFS §2.2's QL, CE and BI over time.

Definitions (AFS/CoDDL §2.2, §5.1):

* JCT = completion − arrival (both whole seconds), averaged over every job.
* Makespan = last completion − first arrival.
* QL (queue length): number of active jobs that hold no GPU.
* CE (cluster efficiency): ``(1/M) · Σ_{j running} thr_j(current GPUs) / thr_j(1)``
  with M the cluster's GPUs.
* BI (blocking index): ``(1/|J_P|) · Σ_{j pending} pending_time_j / remaining_time_j(1 GPU)``;
  0 when nothing is pending. Open point, chosen here: "pending time" is the job's
  cumulative time without GPUs since its arrival (its whole wait, not only the current
  spell), so a job preempted again and again keeps its blocking history.
  ``remaining_time(1 GPU) = remaining iterations / thr_j(1)``.
* The series are sampled after every decision and hold until the next one
  (piecewise constant); time averages integrate them over [first arrival, makespan end].
* GPU utilisation: GPU-seconds held by jobs / (M × makespan), and the share of that
  lost to reconfiguration stops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from msgspec import Struct


class Series(Struct, kw_only=True):
    """Piecewise-constant time series, one sample per decision."""

    t: list[float] = []
    ql: list[int] = []
    ce: list[float] = []
    bi: list[float] = []
    gpus_used: list[int] = []

    def add(self, t: float, ql: int, ce: float, bi: float, gpus_used: int) -> None:
        """Record the values in force from ``t`` on (a sample at the same time replaces the last)."""
        if self.t and self.t[-1] == t:
            self.ql[-1], self.ce[-1], self.bi[-1], self.gpus_used[-1] = ql, ce, bi, gpus_used
            return
        self.t.append(t)
        self.ql.append(ql)
        self.ce.append(ce)
        self.bi.append(bi)
        self.gpus_used.append(gpus_used)

    def time_average(self, name: str, start: float, end: float) -> float:
        """Time-weighted mean of one series over [start, end]."""
        values: Sequence[float] = getattr(self, name)
        if end <= start or not self.t:
            return 0.0
        total = 0.0
        for i, t0 in enumerate(self.t):
            t1 = self.t[i + 1] if i + 1 < len(self.t) else end
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                total += values[i] * (hi - lo)
        return total / (end - start)

    def resampled(self, points: int, start: float, end: float) -> dict[str, list[float]]:
        """The value in force at ``points`` evenly spaced times (for plots and JSON)."""
        if not self.t or points <= 0 or end <= start:
            return {"t": [], "ql": [], "ce": [], "bi": [], "gpus_used": []}
        if len(self.t) <= points:
            return {
                "t": list(self.t),
                "ql": [float(x) for x in self.ql],
                "ce": list(self.ce),
                "bi": list(self.bi),
                "gpus_used": [float(x) for x in self.gpus_used],
            }
        out: dict[str, list[float]] = {"t": [], "ql": [], "ce": [], "bi": [], "gpus_used": []}
        i = 0
        for p in range(points):
            t = start + (end - start) * p / (points - 1)
            while i + 1 < len(self.t) and self.t[i + 1] <= t:
                i += 1
            out["t"].append(t)
            out["ql"].append(float(self.ql[i]))
            out["ce"].append(self.ce[i])
            out["bi"].append(self.bi[i])
            out["gpus_used"].append(float(self.gpus_used[i]))
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default ``linear`` method), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jct_summary(jcts: Sequence[float]) -> dict[str, float]:
    """Average, median and p99 JCT in seconds."""
    if not jcts:
        return {"avg_jct_s": math.nan, "median_jct_s": math.nan, "p99_jct_s": math.nan}
    return {
        "avg_jct_s": sum(jcts) / len(jcts),
        "median_jct_s": percentile(jcts, 50),
        "p99_jct_s": percentile(jcts, 99),
    }

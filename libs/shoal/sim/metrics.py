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
* The series are sampled after every decision. Jobs arrive, finish and change shares
  only at decisions, so QL and CE (and the set J_P) hold until the next one (CE counts a
  job's throughput on its share also during a reconfiguration stop). BI does not: a
  pending job's pending time grows while its remaining time stands still, so between
  decisions ``BI(t) = BI(t_i) + bi_slope_i · (t − t_i)`` with
  ``bi_slope = (1/|J_P|) Σ 1 / remaining_time_j(1 GPU)``; the series keeps the slope and
  time averages and resampling use it, so BI is exact rather than sampled. Time
  averages integrate over [first arrival, makespan end].
* GPU utilisation: GPU-seconds held by jobs / (M × makespan), and the share of that
  lost to reconfiguration stops.
* Received share (Gandiva_fair §2, fairness across users): GPUs each user holds on
  each generation, piecewise constant between decisions (:class:`UserShares`);
  integrated, GPU-seconds per user per generation over any window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from msgspec import Struct


class Series(Struct, kw_only=True):
    """QL, CE, BI and GPUs in use over time, one sample per decision (see the module docstring)."""

    t: list[float] = []
    ql: list[int] = []
    ce: list[float] = []
    bi: list[float] = []
    gpus_used: list[int] = []
    bi_slope: list[float] = []
    """d(BI)/dt from ``t[i]`` until the next sample (pending times grow, remaining times do not)."""

    def add(self, t: float, ql: int, ce: float, bi: float, gpus_used: int, bi_slope: float = 0.0) -> None:
        """Record the values in force from ``t`` on (a sample at the same time replaces the last)."""
        if self.t and self.t[-1] == t:
            self.ql[-1], self.ce[-1], self.bi[-1], self.gpus_used[-1] = ql, ce, bi, gpus_used
            self.bi_slope[-1] = bi_slope
            return
        self.t.append(t)
        self.ql.append(ql)
        self.ce.append(ce)
        self.bi.append(bi)
        self.gpus_used.append(gpus_used)
        self.bi_slope.append(bi_slope)

    def value_at(self, name: str, i: int, t: float) -> float:
        """Value of series ``name`` at time ``t`` within sample ``i``'s interval."""
        value = float(getattr(self, name)[i])
        if name == "bi":
            value += self.bi_slope[i] * (t - self.t[i])
        return value

    def time_average(self, name: str, start: float, end: float) -> float:
        """Time-weighted mean of one series over [start, end] (exact for BI's linear pieces)."""
        values: Sequence[float] = getattr(self, name)
        if end <= start or not self.t:
            return 0.0
        slopes = self.bi_slope if name == "bi" else None
        total = 0.0
        for i, t0 in enumerate(self.t):
            t1 = self.t[i + 1] if i + 1 < len(self.t) else end
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                total += values[i] * (hi - lo)
                if slopes is not None and slopes[i]:
                    total += slopes[i] * ((hi - t0) ** 2 - (lo - t0) ** 2) / 2.0
        return total / (end - start)

    def resampled(self, points: int, start: float, end: float) -> dict[str, list[float]]:
        """The values at ``points`` evenly spaced times in [start, end] (for plots and JSON);
        times before the first sample are left out."""
        if not self.t or points <= 0 or end <= start:
            return {"t": [], "ql": [], "ce": [], "bi": [], "gpus_used": []}
        out: dict[str, list[float]] = {"t": [], "ql": [], "ce": [], "bi": [], "gpus_used": []}
        if points == 1:
            times = [start]
        else:
            times = [start + (end - start) * p / (points - 1) for p in range(points)]
        i = 0
        for t in times:
            while i + 1 < len(self.t) and self.t[i + 1] <= t:
                i += 1
            if t < self.t[0]:
                continue
            out["t"].append(t)
            out["ql"].append(float(self.ql[i]))
            out["ce"].append(self.ce[i])
            out["bi"].append(self.value_at("bi", i, t))
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


class UserShares(Struct, kw_only=True):
    """GPUs held per user per GPU generation over time, one sample per decision.

    ``gpus[user][gpu_type][i]`` is in force from ``t[i]`` to ``t[i + 1]`` (the last one
    to the end of the run). A user/generation first seen later is padded with zeros.
    While sampling, a series is extended only when its value is or was just positive
    (a long trace has many users, few of them running at once); :meth:`pad` (called by
    the readers below and by the simulator's result) brings every series to ``len(t)``.
    """

    t: list[float] = []
    gpus: dict[str, dict[str, list[int]]] = {}
    nonzero: set[tuple[str, str]] = set()
    """Bookkeeping: the (user, gpu_type) series whose newest sample is positive."""

    def add(self, t: float, held: Mapping[tuple[str, str], int]) -> None:
        """Record ``(user, gpu_type) -> GPUs`` in force from ``t`` (same ``t`` replaces)."""
        if self.t and self.t[-1] == t:
            i = len(self.t) - 1
        else:
            i = len(self.t)
            self.t.append(t)
        gpus = self.gpus
        for user, gpu_type in self.nonzero:
            if held.get((user, gpu_type), 0) <= 0:
                values = gpus[user][gpu_type]
                values.extend([0] * (i + 1 - len(values)))
                values[i] = 0
        nonzero = set()
        for key, n in held.items():
            user, gpu_type = key
            values = gpus.setdefault(user, {}).setdefault(gpu_type, [])
            values.extend([0] * (i + 1 - len(values)))
            values[i] = n
            if n > 0:
                nonzero.add(key)
        self.nonzero = nonzero

    def pad(self) -> None:
        """Extend every series with zeros to one value per sample time."""
        n = len(self.t)
        for per_type in self.gpus.values():
            for values in per_type.values():
                values.extend([0] * (n - len(values)))

    def gpu_seconds(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """GPU-seconds each user received on each generation within [start, end]."""
        self.pad()
        out: dict[str, dict[str, float]] = {}
        for user, per_type in self.gpus.items():
            for gpu_type, values in per_type.items():
                total = 0.0
                for i, t0 in enumerate(self.t):
                    t1 = self.t[i + 1] if i + 1 < len(self.t) else end
                    lo, hi = max(t0, start), min(t1, end)
                    if hi > lo:
                        total += values[i] * (hi - lo)
                out.setdefault(user, {})[gpu_type] = total
        return out

    def cumulative(self, points: int, start: float, end: float) -> dict[str, Any]:
        """Cumulative GPU-seconds per user per generation at ``points`` evenly spaced times.

        Returns:
            ``{"t": [...], "gpu_s": {user: {gpu_type: [...]}}}`` (for plots and JSON).
        """
        if points <= 1 or end <= start:
            return {"t": [], "gpu_s": {}}
        self.pad()
        times = [start + (end - start) * p / (points - 1) for p in range(points)]
        t = self.t
        n = len(t)
        out: dict[str, dict[str, list[float]]] = {}
        for user, per_type in self.gpus.items():
            for gpu_type, values in per_type.items():
                acc, i, cur, row = 0.0, 0, start, []
                for tp in times:
                    while cur < tp:
                        while i + 1 < n and t[i + 1] <= cur:
                            i += 1
                        if not n or cur < t[0]:
                            nxt, value = (min(tp, t[0]) if n else tp), 0
                        else:
                            nxt, value = (min(tp, t[i + 1]) if i + 1 < n else tp), values[i]
                        acc += value * (nxt - cur)
                        cur = nxt
                    row.append(acc)
                out.setdefault(user, {})[gpu_type] = row
        return {"t": times, "gpu_s": out}

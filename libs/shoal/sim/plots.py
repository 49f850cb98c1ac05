"""Plots of simulation matrices (matplotlib with the Agg backend, imported lazily).

* :func:`plot_jct_reduction` — average JCT of a baseline divided by each policy's, per
  trace, as grouped bars (AFS Figure 5; above 1 = better than the baseline).
* :func:`plot_jct_cdfs` — CDF of job completion times, one line per policy.
* :func:`plot_metrics_over_time` — QL, CE and BI (log scale) over time, one line per
  policy (AFS Figure 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_jct_reduction(
    avg_jct: Mapping[str, Mapping[str, float]],
    baseline: str,
    path: Path,
    *,
    traces: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    title: str = "",
) -> Path:
    """Grouped bars of ``avg_jct[trace][baseline] / avg_jct[trace][policy]``.

    Args:
        avg_jct: trace -> policy -> average JCT (missing or NaN cells are skipped).
        baseline: the policy every ratio is relative to.
        path: the PNG to write.
        traces: order of the groups (default: as given).
        policies: which bars (default: every policy but the baseline).
        title: figure title.
    """
    plt = _pyplot()
    traces = list(traces or avg_jct)
    if policies is None:
        seen: list[str] = []
        for per in avg_jct.values():
            seen += [p for p in per if p not in seen and p != baseline]
        policies = seen
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(traces) + 2), 3.6))
    for i, policy in enumerate(policies):
        xs, ys = [], []
        for x, trace in enumerate(traces):
            base = avg_jct.get(trace, {}).get(baseline)
            value = avg_jct.get(trace, {}).get(policy)
            if base and value and value == value and base == base:
                xs.append(x + (i - (len(policies) - 1) / 2) * width)
                ys.append(base / value)
        ax.bar(xs, ys, width=width, label=policy)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(traces)))
    ax.set_xticklabels([f"{i + 1}\n{t.split(':')[-1]}" for i, t in enumerate(traces)], fontsize=8)
    ax.set_ylabel(f"avg JCT reduction vs {baseline}")
    ax.set_title(title or f"Average JCT of {baseline} / average JCT of the policy")
    if policies:  # only the baseline: bars of nothing, and no legend to draw
        ax.legend(fontsize=8, ncol=min(4, len(policies)))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_jct_cdfs(jcts: Mapping[str, Sequence[float]], path: Path, *, title: str = "") -> Path:
    """One CDF line per policy of its (sorted) JCTs, hours on a log axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for policy, values in jcts.items():
        xs = sorted(v / 3600 for v in values)
        if not xs:
            continue
        n = len(xs)
        ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("JCT (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title or "JCT CDF")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_metrics_over_time(
    series: Mapping[str, Mapping[str, Sequence[float]]], path: Path, *, title: str = ""
) -> Path:
    """QL, CE and BI (log scale) against days, one line per policy (AFS Figure 2).

    Args:
        series: policy -> ``{"t": [...], "ql": [...], "ce": [...], "bi": [...]}``.
        path: the PNG to write.
        title: figure title.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(7.0, 6.4), sharex=True)
    for policy, s in series.items():
        t = [x / 86400 for x in s.get("t", [])]
        if not t:
            continue
        axes[0].plot(t, s["ql"], label=policy, linewidth=0.9)
        axes[1].plot(t, s["ce"], label=policy, linewidth=0.9)
        # BI is 0 while nothing waits: left out (gaps) on the log axis.
        axes[2].plot(t, [v if v > 0 else float("nan") for v in s["bi"]], label=policy, linewidth=0.9)
    axes[0].set_ylabel("QL")
    axes[1].set_ylabel("CE")
    axes[2].set_ylabel("BI (log; gaps: 0)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("time (days)")
    axes[0].legend(fontsize=8, ncol=min(4, max(1, len(series))))
    axes[0].set_title(title or "QL, CE and BI over time")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

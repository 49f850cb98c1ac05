"""Placement latency: regulate + place a churned round on a large homogeneous cluster.

Each case builds a cluster of ``nodes × 4`` GPUs, draws planned shares for ``jobs`` jobs
(sizes 1–16, scaled to fill the cluster), regulates them (AFS appendix E), places them
with no history (round 1), then churns the jobs (10% leave, 10% arrive, 20% change size)
and times round 2, which has a previous placement to keep. The timed calls are
:func:`regulate_shares`, :func:`place_min_migration` and :func:`place_consolidated`.

Usage::

    python benchmarks/bench_placement.py [--quick] [--out benchmarks/reports/placement_latency.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from shoal.placement import (
    Placement,
    Topology,
    check_placement,
    kept_gpus,
    place_consolidated,
    place_min_migration,
    regulate_shares,
)

GPUS_PER_NODE = 4


def planned(rng: np.random.Generator, jobs: list[str], total: int) -> dict[str, int]:
    """Planned shares (1–16 GPUs, skewed small) scaled so they sum to about ``total``."""
    raw = rng.choice([1, 1, 1, 2, 2, 3, 4, 4, 6, 8, 12, 16], size=len(jobs)).astype(float)
    raw *= total / raw.sum()
    return {j: max(1, int(v)) for j, v in zip(jobs, raw, strict=True)}


def churn(rng: np.random.Generator, jobs: list[str], next_id: int) -> list[str]:
    """10% of jobs leave and as many arrive."""
    leave = set(rng.choice(len(jobs), size=len(jobs) // 10, replace=False).tolist())
    kept = [j for i, j in enumerate(jobs) if i not in leave]
    return kept + [f"job{next_id + i}" for i in range(len(leave))]


def timed(fn: Callable[[], Placement | dict[str, int]], repeats: int) -> tuple[list[float], object]:
    out: object = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return times, out


def run_case(n_nodes: int, n_jobs: int, repeats: int, seed: int = 0) -> list[tuple[str, list[float], str]]:
    rng = np.random.default_rng(seed)
    topo = Topology.homogeneous(n_nodes, GPUS_PER_NODE)
    total = topo.total_gpus
    jobs = [f"job{i}" for i in range(n_jobs)]
    shares1 = regulate_shares(planned(rng, jobs, total), {}, GPUS_PER_NODE, total)
    round1 = place_min_migration(topo, {j: s for j, s in shares1.items() if s}, {})
    previous = round1.placements

    jobs2 = churn(rng, jobs, n_jobs)
    plan2 = planned(rng, jobs2, total)
    # 80% of the surviving jobs keep their old planned size (the allocator's plan moves slowly).
    for j in jobs2:
        if j in shares1 and shares1[j] and rng.random() < 0.8:
            plan2[j] = shares1[j]
    rows: list[tuple[str, list[float], str]] = []
    t, shares2 = timed(lambda: regulate_shares(plan2, {}, GPUS_PER_NODE, total), repeats)
    assert isinstance(shares2, dict)
    rows.append(("regulate_shares", t, f"{sum(shares2.values())}/{total} GPUs given"))
    positive = {j: s for j, s in shares2.items() if s}
    t, p = timed(lambda: place_min_migration(topo, positive, previous), repeats)
    assert isinstance(p, Placement)
    check_placement(topo, positive, p)
    rows.append(
        (
            "place_min_migration",
            t,
            f"{len(p.placements)} placed, {len(p.unplaced)} unplaced, {p.migrations} migrations, "
            f"{kept_gpus(previous, p.placements)} GPUs kept",
        )
    )
    t, q = timed(lambda: place_consolidated(topo, positive, previous), repeats)
    assert isinstance(q, Placement)
    check_placement(topo, positive, q)
    rows.append(
        (
            "place_consolidated",
            t,
            f"{len(q.placements)} placed, {len(q.unplaced)} unplaced, {q.migrations} migrations, "
            f"{kept_gpus(previous, q.placements)} GPUs kept",
        )
    )
    return rows


def fill_case(n_nodes: int, n_jobs: int, repeats: int) -> tuple[list[float], list[float]]:
    """An empty cluster filled by ``n_jobs`` one-GPU newcomers: the shape where
    :func:`place_min_migration` takes its shortcut for kept and new jobs. Returns the
    milliseconds of that call and of the full steps (the shortcut's named baseline), after
    checking that both place the same."""
    from shoal.placement.min_migration import _MinMigration, _place_all

    topo = Topology.homogeneous(n_nodes, GPUS_PER_NODE)
    shares = {f"job{i:05d}": 1 for i in range(n_jobs)}
    place_min_migration(topo, {}, {})  # the topology's index, made once per topology
    t_quick, quick = timed(lambda: place_min_migration(topo, shares, {}), repeats)
    t_full, full = timed(lambda: _place_all(_MinMigration(topo, shares, {}, None), True), repeats)
    assert quick == full
    return t_quick, t_full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats per call instead of 15")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "reports" / "placement_latency.md"
    )
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 15
    cases = [(512, 1000, 100.0), (2500, 5000, 500.0)]
    lines = [
        "# Placement latency",
        "",
        f"Command: `python benchmarks/bench_placement.py{' --quick' if args.quick else ''}`",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, {platform.system()}; "
        f"{repeats} repeats per call, single thread, on a shared machine (other jobs were running).",
        "",
        "Round 2 of a churned workload (10% of jobs leave, 10% arrive, 20% change size) on "
        f"nodes of {GPUS_PER_NODE} GPUs, with round 1's placement as history.",
        "",
        "| nodes × GPUs | jobs | call | median ms | max ms | target ms | outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    ok = True
    for n_nodes, n_jobs, target in cases:
        for name, times, outcome in run_case(n_nodes, n_jobs, repeats):
            med = statistics.median(times)
            if name != "regulate_shares" and med >= target:
                ok = False
            lines.append(
                f"| {n_nodes} × {GPUS_PER_NODE} | {n_jobs} | `{name}` | {med:.1f} | {max(times):.1f} | "
                f"{target:.0f} | {outcome} |"
            )
    lines += ["", f"All placers under target: {'yes' if ok else 'NO'}.", ""]
    lines += [
        "## Filling an empty cluster with one-GPU jobs",
        "",
        "`place_min_migration` on an empty cluster and that many one-GPU newcomers: every job is new, so "
        "it takes its shortcut for kept and new jobs (`shoal.placement.min_migration`). It is compared "
        "with the full steps (`_place_all`) in the same run; both place the same. Not part of the targets "
        "above, which time the churned round.",
        "",
        "| nodes × GPUs | jobs | shortcut median ms | full steps median ms | shortcut / full |",
        "|---|---|---|---|---|",
    ]
    for n_nodes, n_jobs in [(512, 1000), (2500, 5000)]:
        t_quick, t_full = fill_case(n_nodes, n_jobs, repeats)
        q, f = statistics.median(t_quick), statistics.median(t_full)
        lines.append(f"| {n_nodes} × {GPUS_PER_NODE} | {n_jobs} | {q:.1f} | {f:.1f} | {q / f:.1f}× |")
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

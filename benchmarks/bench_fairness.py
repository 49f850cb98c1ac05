"""Gandiva_fair latency: one trading round and one split-stride quantum at scale.

Two cases, each timed against a naive version of the same computation in the same run:

- **Trading**: one second-price trading round (:func:`shoal.fairness.trader.trading_round`)
  for 1,000 users × 4 GPU generations (20,000 GPUs), every user with a random per-generation
  speedup profile and a water-filled fair share of every generation; trading runs
  until no pair gains. Naive: :func:`naive_trading_round`, which re-ranks every bidder
  before each trade. The two must return the same trades.
- **Split stride**: one quantum of split gang-aware stride
  (:func:`shoal.fairness.split_stride.split_stride_quantum`) on 10,000 GPUs
  (2,500 servers × 4) and 20,000 jobs with Philly-like sizes (86.6 % 1-GPU, 2.3 %
  2-GPU, 4.9 % 4-GPU, 6.2 % 8- or 16-GPU), placed on the least ticket-loaded
  servers; quanta are timed back to back so passes carry over. Naive:
  :func:`naive_split_stride_quantum`, which scans all central entries for the
  minimum pass each time. The two must agree.

Usage::

    python benchmarks/bench_fairness.py [--quick] [--out benchmarks/reports/fairness_latency.md]
"""

from __future__ import annotations

import argparse
import functools
import heapq
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.fairness.balance import job_tickets, tickets_per_gpu
from shoal.fairness.shares import fair_shares_by_generation
from shoal.fairness.split_stride import (
    PlacedJob,
    SplitStrideResult,
    naive_split_stride_quantum,
    split_stride_quantum,
)
from shoal.fairness.trader import naive_trading_round, trading_round

TARGET_MS = 100.0
GENERATIONS = {"a100": 2000, "v100": 4000, "p100": 6000, "k80": 8000}
ORDER = ("a100", "v100", "p100", "k80")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation), q in [0, 100]."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * q // 100)))
    return ordered[int(rank) - 1]


class Times:
    """CPU and wall-clock milliseconds of each repeat."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def measure(self, fn: Callable[[], Any]) -> Any:
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        self.cpu.append((time.process_time() - c0) * 1000)
        self.wall.append((time.perf_counter() - w0) * 1000)
        return out


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Times, Any]:
    out: Any = None
    times = Times()
    for _ in range(repeats):
        out = times.measure(fn)
    return times, out


def trading_case(users: int, seed: int) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Entitlements and rates for ``users`` users over :data:`GENERATIONS`."""
    rng = random.Random(seed)
    names = [f"user{i:04d}" for i in range(users)]
    tickets = {u: float(rng.choice([50, 100, 100, 200])) for u in names}
    demand = {u: dict.fromkeys(GENERATIONS, 1e9) for u in names}
    entitlements = fair_shares_by_generation(tickets, demand, GENERATIONS)
    rates: dict[str, dict[str, float]] = {}
    for u in names:
        p100 = rng.uniform(1.1, 4.0)
        v100 = p100 * rng.uniform(1.0, 1.8)
        a100 = v100 * rng.uniform(1.0, 2.0)
        rates[u] = {"k80": 1.0, "p100": p100, "v100": v100, "a100": a100}
    return entitlements, rates


def stride_case(
    servers: int, gpus_per_server: int, jobs: int, seed: int
) -> tuple[dict[str, int], list[PlacedJob]]:
    """A cluster and its jobs, placed on the least ticket-loaded servers (§3.2)."""
    rng = random.Random(seed)
    server_gpus = {f"s{i:05d}": gpus_per_server for i in range(servers)}
    sizes = rng.choices([1, 2, 4, 8, 16], weights=[86.6, 2.3, 4.9, 4.5, 1.7], k=jobs)
    users = [f"u{rng.randrange(jobs // 20):04d}" for _ in range(jobs)]
    by_user: dict[str, list[int]] = {}
    for u, s in zip(users, sizes, strict=True):
        by_user.setdefault(u, []).append(s)
    tpg = tickets_per_gpu({u: 100.0 for u in by_user}, by_user)
    heap = [(0.0, name) for name in server_gpus]  # (ticket load per GPU, server)
    heapq.heapify(heap)
    placed: list[PlacedJob] = []
    for k, (u, s) in enumerate(zip(users, sizes, strict=True)):
        span = max(1, -(-s // gpus_per_server))
        chosen = [heapq.heappop(heap) for _ in range(span)]
        per = min(s, gpus_per_server)
        for load, name in chosen:
            heapq.heappush(heap, (load + per * tpg[u] / gpus_per_server, name))
        placed.append(
            PlacedJob(
                job_id=f"j{k:05d}",
                size=s,
                job_tickets=job_tickets(tpg[u], s),
                servers=tuple(sorted(name for _, name in chosen)),
                arrival_s=float(k),
            )
        )
    return server_gpus, placed


def run_quanta(
    fn: Callable[..., SplitStrideResult], server_gpus: dict[str, int], jobs: list[PlacedJob], quanta: int
) -> tuple[Times, list[SplitStrideResult]]:
    central: dict[str, float] = {}
    local: dict[str, float] = {}
    times = Times()
    results = []
    for _ in range(quanta):
        res = times.measure(functools.partial(fn, server_gpus, jobs, central, local))
        central, local = res.central_passes, res.local_passes
        results.append(res)
    return times, results


def row(case: str, impl: str, times: Times, outcome: str) -> str:
    c, w = times.cpu, times.wall
    return (
        f"| {case} | {impl} | {len(c)} | {percentile(c, 50):.1f} | {percentile(c, 99):.1f} | {max(c):.1f} | "
        f"{percentile(w, 50):.1f} | {percentile(w, 99):.1f} | {TARGET_MS:.0f} | {outcome} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (sizes unchanged)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports/fairness_latency.md"))
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else 200
    naive_repeats = 1 if args.quick else 5

    lines: list[str] = []
    ok = True
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    entitlements, rates = trading_case(1000, seed=1)
    fast_t, trades = timed(lambda: trading_round(entitlements, rates, ORDER), repeats)
    naive_t, naive_trades = timed(lambda: naive_trading_round(entitlements, rates, ORDER), naive_repeats)
    same = trades == naive_trades
    ok &= same and percentile(fast_t.cpu, 99) < TARGET_MS
    outcome = (
        f"{len(trades)} trades, {sum(t.fast_gpus for t in trades)} fast GPUs moved; naive agrees: {same}"
    )
    case = "trading, 1,000 users × 4 generations"
    lines.append(row(case, "`trading_round`", fast_t, outcome))
    lines.append(row(case, "`naive_trading_round`", naive_t, "re-ranks bidders before every trade"))

    server_gpus, jobs = stride_case(2500, 4, 20_000, seed=2)
    fast_t, fast_res = run_quanta(split_stride_quantum, server_gpus, jobs, repeats)
    naive_t, naive_res = run_quanta(naive_split_stride_quantum, server_gpus, jobs, naive_repeats)
    same = fast_res[:naive_repeats] == naive_res
    ok &= same and percentile(fast_t.cpu, 99) < TARGET_MS
    busy = sum(server_gpus.values()) - fast_res[-1].idle_gpus
    outcome = (
        f"{len(fast_res[-1].scheduled)} jobs run, {busy}/{sum(server_gpus.values())} GPUs busy "
        f"in the last quantum; naive agrees: {same}"
    )
    case = "split stride, 10,000 GPUs × 20,000 jobs"
    lines.append(row(case, "`split_stride_quantum`", fast_t, outcome))
    lines.append(row(case, "`naive_split_stride_quantum`", naive_t, "O(entries²) minimum scans"))

    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = os.cpu_count() or 0
    command = "python benchmarks/bench_fairness.py" + (" --quick" if args.quick else "")
    report = [
        "# Gandiva_fair latency",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {cores} cores, Python {platform.python_version()}, "
        f"{platform.system()}; single thread, on a shared machine: 1-minute load average "
        f"{load_before:.1f} before and {load_after:.1f} after the run.",
        "",
        "Each repeat is timed twice: CPU time of this process (`time.process_time`) and wall-clock time. "
        "With the load above the core count, wall-clock time includes waiting for a core that other jobs "
        "hold, so the target is judged on the CPU time; on a dedicated allocator core the two coincide. "
        "p99 is the nearest-rank percentile of the repeats (with few repeats it is the maximum). "
        "The naive versions run fewer repeats (they are slow); the fast and naive versions run in the "
        "same process, one after the other, on the same inputs.",
        "",
        "| case | implementation | repeats | CPU p50 ms | CPU p99 ms | CPU max ms | wall p50 ms | wall p99 ms "
        "| target p99 ms | outcome |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        f"Both fast paths under target (CPU p99) and equal to the naive versions: {'yes' if ok else 'no'}.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report))
    sys.stdout.write("\n".join(report))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

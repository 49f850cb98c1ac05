"""Where a simulation's CPU goes, by part of shoal: a profile of named runs.

Each run is ``shoal simulate`` on a Philly VC, seed 0, log not retained, as
``bench_sim.py`` runs it (the same simulator set-up and CPU-time stop), under
:mod:`cProfile` with its default clock, in a child process of its own. The profiler's
per-call overhead inflates small, frequent calls, so the seconds are the profiled
run's, not a plain run's (``bench_sim.py`` measures those); the shares say where the
time goes. The CPU limit is on the process's CPU clock, the profiler's seconds are its
own clock's (the two agree while nothing else competes for the core).

The time of every function is put in one part by the file it is defined in:

- ``policy``: ``shoal/policies``, ``shoal/fairness`` (the policy's own ``decide``);
- ``placement and checks``: ``shoal/placement``, ``shoal/allocation.py`` (the checks
  of each decision, packing, regulation, placement);
- ``views``: ``shoal/view.py`` (the job views the policy reads);
- ``fold``: ``shoal/state.py`` (the events applied to the cluster state);
- ``events and log``: ``shoal/events.py``, ``shoal/codec.py``, ``shoal/sim/log.py``;
- ``metrics``: ``shoal/sim/metrics.py``;
- ``engine``: the rest of ``shoal/sim`` (the clock, progress, reconfigurations);
- ``other``: anything else (the standard library, the bench's own stop).

A built-in or C function (``len``, ``sorted``, numpy, msgspec) is put in the part of
the function that called it, call edge by call edge, as the profile records them; so
are the helpers of ``shoal/policies/base.py`` and ``common.py``, which the policies and
the engine's checks both call (``check_decision`` counts where its caller does).

Usage::

    python benchmarks/profile_sim.py --runs 2869ce:themis:topology,6214e9:afs-p:flat \\
        --cpu-limit 60 --out benchmarks/reports/simulation_profile_targets.md
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("policy", ("shoal/policies/", "shoal/fairness/")),
    ("placement and checks", ("shoal/placement/", "shoal/allocation.py")),
    ("views", ("shoal/view.py",)),
    ("fold", ("shoal/state.py",)),
    ("events and log", ("shoal/events.py", "shoal/codec.py", "shoal/sim/log.py")),
    ("metrics", ("shoal/sim/metrics.py",)),
    ("engine", ("shoal/sim/",)),
)
ORDER = [name for name, _ in PARTS] + ["other"]


HELPERS = ("shoal/policies/base.py", "shoal/policies/common.py")
"""Helpers of the policies that the engine's checks call too (``check_decision``,
``feasible_counts``): their time goes to their callers' parts, as a built-in's does."""


def part_of(filename: str) -> str | None:
    """The part a function defined in ``filename`` belongs to; None for a built-in or a
    shared helper (see :data:`HELPERS`), whose part is its callers'."""
    if filename.startswith("~") or filename.startswith("<"):
        return None
    path = filename.replace(os.sep, "/")
    if any(h in path for h in HELPERS):
        return None
    for name, prefixes in PARTS:
        if any(p in path for p in prefixes):
            return name
    return "other"


def attribute(stats: pstats.Stats) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Seconds per part, and every function's own time.

    A function with a part of its own counts there. A built-in or a shared helper is
    split over its callers by the time it spent on each call edge, each caller's share
    going where that caller's own time goes (a helper called by a helper follows it up).
    """
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    memo: dict[Any, dict[str, float]] = {}

    def where_goes(key: Any, seen: frozenset[Any] = frozenset()) -> dict[str, float]:
        if key in memo:
            return memo[key]
        part = part_of(key[0])
        if part is not None:
            return {part: 1.0}
        if key in seen or key not in raw:
            return {"other": 1.0}
        callers = raw[key][4]
        weights = {c: edge[2] for c, edge in callers.items()}
        if sum(weights.values()) <= 0:
            weights = {c: float(edge[1]) for c, edge in callers.items()}
        total = sum(weights.values())
        if total <= 0:
            return {"other": 1.0}
        dist: dict[str, float] = {}
        for c, w in weights.items():
            for p, f in where_goes(c, seen | {key}).items():
                dist[p] = dist.get(p, 0.0) + f * w / total
        memo[key] = dist
        return dist

    parts = dict.fromkeys(ORDER, 0.0)
    rows: list[dict[str, Any]] = []
    for key, (_cc, calls, tottime, _ct, _callers) in raw.items():
        filename, line, func = key
        dist = where_goes(key)
        for p, f in dist.items():
            parts[p] += tottime * f
        label = max(dist, key=lambda p: dist[p])
        if part_of(filename) is None:
            label = f"{label} (by its callers)"
        if filename.startswith("~") or filename.startswith("<"):
            name = func
        else:
            path = filename.replace(os.sep, "/")
            path = path[path.find("shoal/") :] if "shoal/" in path else Path(path).name
            name = f"{func} ({path}:{line})"
        rows.append({"function": name, "part": label, "own_s": tottime, "calls": calls})
    rows.sort(key=lambda r: -r["own_s"])
    return parts, rows


def child(run: str, limit_s: float) -> dict[str, Any]:
    """Profile one run in this process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_sim  # the same simulator set-up and CPU-time stop as the speed report
    from shoal.workloads import load_workload

    vc, policy_name, setting = run.split(":")
    trace = f"philly:{vc}"
    jobs = load_workload(trace, seed=0)
    limited = bench_sim._Limited(bench_sim.policy_named(policy_name), limit_s)
    sim = bench_sim.simulator(jobs, trace, limited, setting)
    # The profiler's default clock: a CPU clock (a system call per reading) made it
    # ten times slower than a plain run, drowning the shares in its own overhead.
    profile = cProfile.Profile()
    status = "ok"
    c0 = time.process_time()
    profile.enable()
    try:
        sim.run()
    except bench_sim._Stop:
        status = "CPU limit"
    finally:
        profile.disable()
    cpu = time.process_time() - c0
    parts, rows = attribute(pstats.Stats(profile))
    return {
        "run": run,
        "status": status,
        "cpu_s": cpu,
        "jobs": len(jobs),
        "completed": sum(1 for j in sim.jobs.values() if j.finished_at is not None),
        "decisions": sim.decisions,
        "events": len(sim.log),
        "parts": parts,
        "top": rows[:25],
    }


def render(results: list[dict[str, Any]], cmd: str) -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    load = os.getloadavg()[0]
    out = [
        "# Where a simulation's CPU goes, by part of shoal",
        "",
        f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at "
        f"{head.stdout.strip() or 'an unknown commit'}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}; "
        f"load average at the end {load:.1f}.",
        "",
        "Each run is a child process: `shoal simulate` on the VC, seed 0, log not retained, "
        "`flat` = one 64-GPU pool, `topology` = 16 servers x 4 with placement; profiled with "
        "cProfile (its default clock), stopped at its first decision past the CPU limit (process CPU). "
        "The profiler inflates small, frequent calls, so the seconds are the profiled run's "
        "(`bench_sim.py` has the plain ones); the shares say where the time goes. Parts are "
        "by the file a function is defined in (see the script's docstring); built-in and C "
        "functions, and the policies' shared helpers, count in their callers' parts.",
        "",
        "## By part",
        "",
        "| run | status | jobs done | decisions | CPU s (profiled) | " + " | ".join(ORDER) + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(ORDER),
    ]
    for r in results:
        total = sum(r["parts"].values()) or 1.0
        cells = " | ".join(f"{100 * r['parts'][p] / total:.0f}%" for p in ORDER)
        out.append(
            f"| {r['run']} | {r['status']} | {r['completed']:,}/{r['jobs']:,} | {r['decisions']:,} "
            f"| {r['cpu_s']:.1f} | {cells} |"
        )
    for r in results:
        total = sum(r["parts"].values()) or 1.0
        out += [
            "",
            f"## {r['run']}: the functions with the most own time",
            "",
            "| function | part | calls | own s | share |",
            "|---|---|---:|---:|---:|",
        ]
        for row in r["top"][:15]:
            out.append(
                f"| `{row['function']}` | {row['part']} | {row['calls']:,} | {row['own_s']:.2f} "
                f"| {100 * row['own_s'] / total:.1f}% |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="", help="VC:POLICY:SETTING,... (setting: flat or topology)")
    ap.add_argument("--cpu-limit", type=float, default=60.0, help="profiled CPU s before a run is stopped")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.cpu_limit)))
        return 0
    runs = [r for r in args.runs.split(",") if r]
    if not runs:
        ap.error("--runs names at least one VC:POLICY:SETTING")
    for r in runs:
        if len(r.split(":")) != 3 or r.split(":")[2] not in ("flat", "topology"):
            ap.error(f"a run is VC:POLICY:flat or VC:POLICY:topology, got {r!r}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), os.environ.get("PYTHONPATH", "")]))
    results = []
    for r in runs:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", r, "--cpu-limit", str(args.cpu_limit)],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            raise SystemExit(f"{r}: the child failed (exit {proc.returncode})")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        total = sum(res["parts"].values()) or 1.0
        print(
            f"{r}: {res['status']}, {res['cpu_s']:.1f} CPU s, "
            + ", ".join(f"{p} {100 * res['parts'][p] / total:.0f}%" for p in ORDER),
            flush=True,
        )
        results.append(res)
    cmd = "python benchmarks/profile_sim.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(results, cmd)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

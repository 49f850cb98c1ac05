"""Simulation speed: jobs simulated per second, per policy, on whole Philly VCs.

Targets (issue "Simulation speed"): the whole 956-job VC 2869ce with AFS-P in under
10 s, and the 51,258-job VC 6214e9 in under 5 minutes, each on one core.

Every run is one process, one core, one after another (no parallelism, so the runs
do not compete with each other). Each run is timed twice: CPU seconds of this process
(``time.process_time``; what one core spends, robust to other load on the machine) and
wall-clock seconds (what a user waits; inflated when the machine is shared). Loading
the workload is timed separately and not counted.

The named baseline, measured in the same run, is ``engine-only``: a FIFO that gives
each job its request in arrival order and never looks at curves, so its time is the
engine's own cost (fold, view, packing, placement, metrics); a policy's time above
it is the policy's. Every policy runs in the default setting of ``shoal simulate``
(64 GPUs as 16 servers × 4, network packing, min-migration placement, ``coddl``
costs), with the log not retained (``retain_log=False``, as for any long trace).
A run past ``--cpu-limit`` CPU seconds is stopped and reported with how far it got.
On the big trace FIFO never displaces a job, so its queue grows to thousands and every
decision walks it: there the baseline measures a long queue, not the bare engine, and
runs under its own, shorter ``--baseline-limit``. The big trace's targets run first.
Last, ``--large-flat-policies`` (default AFS-P) run on the big trace in the flat setting
of ``shoal simulate --flat`` (one 64-GPU pool, no packing, no placement, free
reconfigurations: the AFS simulator's setting), to show what placement costs.

Usage::

    python benchmarks/bench_sim.py [--quick] [--out benchmarks/reports/simulation_speed.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shoal.policies.base import ClusterView, Decision, Policy
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.sim.matrix import RunTimeout
from shoal.workloads import load_workload

TARGETS = {("philly:2869ce", "afs-p"): 10.0, ("philly:6214e9", "afs-p"): 300.0}


class EngineOnlyFifo:
    """The baseline: requested GPUs in arrival order; running jobs keep theirs."""

    name = "engine-only"

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        free = view.total_gpus - sum(j.current_gpus for j in view.jobs)
        shares = {j.job_id: j.current_gpus for j in view.jobs if j.current_gpus}
        for job in view.jobs:  # arrival order
            if job.job_id not in shares and job.requested_gpus <= free:
                shares[job.job_id] = job.requested_gpus
                free -= job.requested_gpus
        return Decision(shares=shares)


class _Limited:
    """Stop a run after a CPU-time deadline (checked at each decision)."""

    def __init__(self, policy: Policy, limit_s: float) -> None:
        self._policy = policy
        self._deadline = time.process_time() + limit_s
        self.name = policy.name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._policy, attr)

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        if time.process_time() > self._deadline:
            raise RunTimeout
        return self._policy.decide(view, memory)


def run(trace: str, policy_name: str, cpu_limit: float, *, flat: bool = False) -> dict[str, Any]:
    """Simulate one (trace, policy) and time it (``flat``: the AFS simulator's flat pool)."""
    jobs = load_workload(trace, seed=0)
    policy: Policy = EngineOnlyFifo() if policy_name == "engine-only" else make_policy(policy_name, seed=0)
    sim = Simulator(jobs, _Limited(policy, cpu_limit), SimConfig(retain_log=False, flat=flat), trace=trace)
    c0, w0 = time.process_time(), time.perf_counter()
    status = "ok"
    decisions = 0.0
    try:
        result = sim.run()
        decisions = result.summary["decisions"]
    except RunTimeout:
        status = "CPU limit"
    except Exception as exc:  # reported in the table, never hidden
        status = f"error: {type(exc).__name__}: {str(exc)[:80]}"
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    completed = sum(1 for j in sim.jobs.values() if j.finished_at is not None)
    return {
        "trace": trace,
        "policy": policy_name,
        "setting": "flat" if flat else "topology",
        "jobs": len(jobs),
        "completed": completed,
        "cpu_s": cpu,
        "wall_s": wall,
        "decisions": decisions or sim.decisions,
        "status": status,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports/simulation_speed.md"))
    parser.add_argument(
        "--policies", default="", help="policies run on the small trace (default: every registered policy)"
    )
    parser.add_argument("--small", default="philly:2869ce", help="trace every policy runs on")
    parser.add_argument("--large", default="philly:6214e9", help="the big trace")
    parser.add_argument(
        "--large-policies", default="afs-p", help="policies (besides the baseline) run on the big trace"
    )
    parser.add_argument("--cpu-limit", type=float, default=600.0, help="CPU seconds before a run is stopped")
    parser.add_argument(
        "--baseline-limit", type=float, default=120.0, help="CPU seconds for the baseline on the big trace"
    )
    parser.add_argument(
        "--large-flat-policies",
        default="afs-p",
        help="policies also run on the big trace in the flat setting (`shoal simulate --flat`: one pool "
        "of 64 GPUs, no packing or placement, free reconfigurations); empty to skip",
    )
    parser.add_argument("--quick", action="store_true", help="small trace only (a smoke run)")
    args = parser.parse_args(argv)

    from shoal.policies.registry import policy_names

    known = set(policy_names())
    policies = [p for p in args.policies.split(",") if p] or sorted(known)
    plan: list[tuple[str, str, bool]] = []
    if not args.quick:  # the big trace's target first: it matters most if time runs out
        plan += [(args.large, p, False) for p in args.large_policies.split(",") if p]
    plan += [(args.small, "engine-only", False)] + [(args.small, p, False) for p in policies]
    if not args.quick:
        plan += [(args.large, "engine-only", False)]
        plan += [(args.large, p, True) for p in args.large_flat_policies.split(",") if p]
    rows: list[dict[str, Any]] = []
    for trace, policy, flat in plan:
        if policy != "engine-only" and policy not in known:
            rows.append({"trace": trace, "policy": policy, "status": "not registered"})
            continue
        limit = args.baseline_limit if (trace == args.large and policy == "engine-only") else args.cpu_limit
        row = run(trace, policy, limit, flat=flat)
        rows.append(row)
        print(
            f"{trace:>16} {policy:>18} {row['setting']:>8}: {row['status']:>10} cpu {row['cpu_s']:8.2f} s "
            f"wall {row['wall_s']:8.2f} s {row['completed']}/{row['jobs']} jobs",
            file=sys.stderr,
            flush=True,
        )
        # The report is rewritten after every run, so an interrupted benchmark keeps
        # what it measured (and says which runs are missing).
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render(rows, args, argv, pending=[(t, p) for t, p, _ in plan[len(rows) :]]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, args, argv))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def render(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    argv: list[str] | None,
    pending: list[tuple[str, str]] | None = None,
) -> str:
    cmd = "python benchmarks/bench_sim.py " + " ".join(argv if argv is not None else sys.argv[1:])
    base = {
        (r["trace"], r.get("setting")): r
        for r in rows
        if r["policy"] == "engine-only" and r.get("status") == "ok"
    }
    lines = [
        "# Simulation speed",
        "",
        f"Generated by `{cmd.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"load average at the end {os.getloadavg()[0]:.1f} (the machine is shared: wall-clock times are "
        "inflated by other work, CPU seconds are what this process used on its one core).",
        "",
        "Setting: `shoal simulate` defaults — 64 GPUs as 16 servers × 4, network packing, min-migration "
        "placement, `coddl` reconfiguration costs, seed 0, log not retained. One run at a time, one process. "
        "`engine-only` is the named baseline in the same run (FIFO that never reads curves: the engine's own "
        "cost). `× baseline` = the policy's CPU seconds / engine-only's on the same trace and setting. "
        "Setting `flat` is `shoal simulate --flat` (one pool, no packing, no placement, free "
        "reconfigurations: the AFS simulator), run on the big trace only.",
        "",
        "| trace | setting | policy | jobs | completed | CPU s | wall s | jobs/s (CPU) | decisions "
        "| ms/decision (CPU) | × baseline | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "cpu_s" not in r:
            lines.append(f"| {r['trace']} | | {r['policy']} | | | | | | | | | {r['status']} |")
            continue
        jps = r["completed"] / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")
        ms = 1000 * r["cpu_s"] / r["decisions"] if r["decisions"] else float("nan")
        b = base.get((r["trace"], r["setting"]))
        ratio = f"{r['cpu_s'] / b['cpu_s']:.1f}" if b and b["cpu_s"] > 0 else ""
        lines.append(
            f"| {r['trace']} | {r['setting']} | {r['policy']} | {r['jobs']:,} | {r['completed']:,} | {r['cpu_s']:.2f} | "
            f"{r['wall_s']:.2f} | {jps:,.0f} | {int(r['decisions']):,} | {ms:.2f} | {ratio} | {r['status']} |"
        )
    if pending:
        lines += [
            "",
            "Not measured (the benchmark was interrupted before these runs): "
            + ", ".join(f"{p} on {t}" for t, p in pending)
            + ".",
        ]
    lines += ["", "Targets:", ""]
    for (trace, policy), limit in TARGETS.items():
        hit = [
            r
            for r in rows
            if r["trace"] == trace
            and r["policy"] == policy
            and r.get("setting") == "topology"
            and "cpu_s" in r
        ]
        if not hit:
            lines.append(f"- {policy} on {trace} under {limit:g} s: not run in this report.")
            continue
        r = hit[0]
        ok = r["status"] == "ok" and r["cpu_s"] < limit
        lines.append(
            f"- {policy} on {trace} ({r['jobs']:,} jobs) under {limit:g} s on one core: "
            f"{'met' if ok else 'NOT met'} — {r['cpu_s']:.1f} CPU s ({r['wall_s']:.1f} s wall), status {r['status']}."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

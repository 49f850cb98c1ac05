"""Tiresias-L checked against a second, independent implementation (issue 23, point 9).

``shoal.policies.tiresias.TiresiasL`` keeps its queues as positions in the policy's
memory, walks never-started jobs lazily and runs inside the shared simulator. This
script re-implements the AFS evaluation's Tiresias-L a second way, as the Tiresias
authors' simulator (``SymbioticLab/Tiresias``, ``dlas-gpu``) structures it: a plain
event loop over Python lists, one list per queue, with ``append``/``remove``, and none of
shoal's code except the workload loader. It runs the same jobs (same models and
iteration counts, seed 0) on the same flat pool of 64 GPUs as the AFS reproduction's
flat setting, and the two are compared job by job.

The rules both follow (``shared/REPRODUCTION.md`` "Tiresias-L", AFS §5.1, and the
reference's ``dlas-gpu``; the module docstring of ``shoal.policies.tiresias`` cites
each):

* two queues split at 50 GPU-hours (180,000 GPU-s) of service counted since the job's
  last restart; no starvation rule;
* an arrival is appended to the back of ``Q0``; a job whose service reaches the
  threshold is removed from its queue and appended to the back of ``Q1`` (demotions in
  arrival order), at the instant it crosses it;
* the pass: queues in order, each in list order; a job gets its requested GPUs when
  they fit in the free ones, and the scan goes on past a job that does not fit
  (backfill); a running job not given GPUs is preempted;
* a job given GPUs while it held none restarts: its count starts again and, if it was
  in ``Q1``, it is appended to the back of ``Q0``;
* after the pass, in every queue the jobs without GPUs move behind those with GPUs,
  each group in its order.

Time is modelled as the simulator models it for the flat setting, so that the two can
agree to the second: reconfigurations are free; a job on ``k`` GPUs makes
``throughput[k]`` iterations a second; completions and demotion instants are rounded up
to whole seconds; at one instant completions come first, then arrivals, then one
decision.

Usage::

    python benchmarks/tiresias_reference.py            # writes benchmarks/reports/tiresias_reference.md
    python benchmarks/tiresias_reference.py --vc 2869ce --vc b436b2:2000 --sensitivity-vc b436b2
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "libs"))

THRESHOLD_GPU_S = 180_000.0
TOTAL_GPUS = 64
EPS = 1e-6
DEFAULT_VCS = (
    "ed69ec",
    "103959",
    "2869ce",
    "e13805",
    "7f04ca",
    "0e4a51",
    "b436b2",
    "ee9e8c",
    "6c71a0",
    "11cb48",
    "6214e9",
)
"""Every VC of the AFS reproduction, the largest (6214e9, 51,258 jobs) last."""


class RefJob:
    """One job of the reference simulation."""

    def __init__(self, tj: Any) -> None:
        spec = tj.spec
        self.id: str = tj.job_id
        self.arrival: float = tj.submit_time_s
        self.total = float(spec.total_iterations or 0)
        self.gang = gang(spec)
        curve = tj.throughput
        self.rate = float(curve[self.gang]) if self.gang < len(curve) else float(curve[-1])
        self.done = 0.0
        self.gpus = 0
        self.since = 0.0  # when the current run started
        self.service_base = 0.0  # service at the last restart
        self.service = 0.0  # attained service (GPU-s) up to ``since``
        self.first_start = math.inf
        self.version = 0


def gang(spec: Any) -> int:
    """The requested GPUs when they are a feasible count, else the largest below, else the smallest."""
    if not spec.elastic:
        counts = [spec.requested_gpus]
    else:
        counts = list(range(spec.min_gpus, spec.max_gpus + 1))
        if spec.allowed_gpu_counts:
            counts = [c for c in counts if c in set(spec.allowed_gpu_counts)]
    if not counts:
        return 0
    if spec.requested_gpus in counts:
        return int(spec.requested_gpus)
    below = [c for c in counts if c <= spec.requested_gpus]
    return int(below[-1] if below else counts[0])


def simulate(
    trace_jobs: list[Any],
    total_gpus: int = TOTAL_GPUS,
    *,
    since_restart: bool = True,
    wake_at_crossing: bool = True,
    keep_lists: bool = True,
) -> dict[str, float]:
    """Run the reference Tiresias-L; returns each job's completion time.

    The keyword arguments change one rule each, to show that the comparison notices:
    ``since_restart=False`` counts all service and keeps a restarted job in its queue (the
    reference's own ``dlas-gpu``; shoal's ``service_since_restart=False``);
    ``wake_at_crossing=False`` demotes only at the next arrival or completion;
    ``keep_lists=False`` orders each queue by first start, then arrival (shoal's rule
    before issue 23).
    """
    jobs = sorted((RefJob(tj) for tj in trace_jobs), key=lambda j: (j.arrival, j.id))
    queues: list[list[RefJob]] = [[], []]
    finish_heap: list[tuple[float, int, str, int]] = []
    by_id = {j.id: j for j in jobs}
    completion: dict[str, float] = {}
    nxt = 0
    now = 0.0
    seq = 0
    wake: float | None = None
    active = 0

    def service(j: RefJob, t: float) -> float:
        return j.service + j.gpus * (t - j.since) - j.service_base

    def settle(j: RefJob, t: float) -> None:
        j.done = min(j.total, j.done + j.rate * (t - j.since)) if j.gpus else j.done
        j.service += j.gpus * (t - j.since)
        j.since = t

    while nxt < len(jobs) or active:
        t_next = jobs[nxt].arrival if nxt < len(jobs) else math.inf
        while finish_heap and by_id[finish_heap[0][2]].version != finish_heap[0][3]:
            heapq.heappop(finish_heap)
        if finish_heap:
            t_next = min(t_next, finish_heap[0][0])
        if wake is not None and wake > now:
            t_next = min(t_next, wake)
        if math.isinf(t_next):
            raise RuntimeError(f"stalled at t={now}")
        now = t_next
        # Completions first.
        while finish_heap and finish_heap[0][0] <= now:
            _, _, jid, version = heapq.heappop(finish_heap)
            j = by_id[jid]
            if j.version != version:
                continue
            settle(j, now)
            j.gpus = 0
            completion[jid] = now
            for q in queues:
                if j in q:
                    q.remove(j)
            active -= 1
        # Arrivals: appended to the back of Q0.
        while nxt < len(jobs) and jobs[nxt].arrival <= now:
            j = jobs[nxt]
            j.since = now
            queues[0].append(j)
            nxt += 1
            active += 1
        # Demotions, in arrival order: to the back of Q1.
        for j in sorted(queues[0], key=lambda j: (j.arrival, j.id)):
            if service(j, now) + EPS >= THRESHOLD_GPU_S:
                queues[0].remove(j)
                queues[1].append(j)
        # The pass.
        free = total_gpus
        given: set[str] = set()
        for q in queues:
            for j in q:
                if free <= 0:
                    break
                if 0 < j.gang <= free:
                    given.add(j.id)
                    free -= j.gang
        restarted: list[RefJob] = []
        for q in queues:
            for j in list(q):
                running = j.gpus > 0
                if j.id in given and not running:
                    settle(j, now)
                    j.gpus = j.gang
                    if since_restart:
                        j.service_base = j.service  # the count starts again
                    j.first_start = min(j.first_start, now)
                    restarted.append(j)
                elif j.id not in given and running:
                    settle(j, now)
                    j.gpus = 0
                    j.version += 1
        for j in restarted:
            if since_restart and j in queues[1]:  # re-enters Q0 at its back
                queues[1].remove(j)
                queues[0].append(j)
            j.version += 1
            seq += 1
            t = float(math.ceil(now + (j.total - j.done) / j.rate - EPS)) if j.rate > 0 else math.inf
            heapq.heappush(finish_heap, (max(t, now), seq, j.id, j.version))
        # After the pass: in each queue, jobs without GPUs go behind those with GPUs.
        for i, q in enumerate(queues):
            if keep_lists:
                queues[i] = [j for j in q if j.gpus] + [j for j in q if not j.gpus]
            else:
                queues[i] = sorted(q, key=lambda j: (j.first_start, j.arrival, j.id))
        # Re-run at the next demotion.
        wake = None
        for j in queues[0] if wake_at_crossing else ():
            if j.gpus:
                at = now + max(0.0, THRESHOLD_GPU_S - service(j, now)) / j.gpus
                at = float(math.ceil(at - EPS))
                wake = at if wake is None else min(wake, at)
    return completion


def shoal_run(trace_jobs: list[Any], **params: Any) -> dict[str, float]:
    """shoal's simulator and ``TiresiasL`` (with ``params``) on the same jobs: completion times."""
    from shoal.sim.engine import SimConfig, Simulator, make_policy

    config = SimConfig(total_gpus=TOTAL_GPUS, flat=True, retain_log=False)
    result = Simulator(trace_jobs, make_policy("tiresias-l", params), config).run()
    return {o.job_id: float(o.completion_s) for o in result.jobs if o.completion_s is not None}


def agreement(tjs: list[Any], ref: dict[str, float], got: dict[str, float]) -> dict[str, Any]:
    """Average JCTs and how many jobs end at the same second."""
    arrival = {tj.job_id: tj.submit_time_s for tj in tjs}
    differs = sorted((j for j in ref if got.get(j) != ref[j]), key=lambda k: (ref[k], k))
    return {
        "jobs": len(tjs),
        "ref_completed": len(ref),
        "shoal_completed": len(got),
        "avg_ref": statistics.fmean(ref[j] - arrival[j] for j in ref),
        "avg_shoal": statistics.fmean(got[j] - arrival[j] for j in got),
        "same": len(ref) - len(differs),
        "first_diff": (differs[0], ref[differs[0]], got.get(differs[0])) if differs else None,
    }


def stored_cell_avg(vc: str) -> float | None:
    """The average JCT of the AFS reproduction's stored flat Tiresias-L cell for ``vc`` (seed 0)."""
    path = ROOT / f"benchmarks/reports/afs_reproduction/cells/flat__{vc}__tiresias-l__s0.json"
    if not path.exists():
        return None
    value = json.loads(path.read_text())["outcome"]["summary"].get("avg_jct_s")
    return float(value) if value is not None else None


def _row(label: str, r: dict[str, Any], cell: str = "") -> str:
    diff = (r["avg_shoal"] - r["avg_ref"]) / r["avg_ref"] * 100
    first = "none"
    if r["first_diff"] is not None:
        job, t_ref, t_shoal = r["first_diff"]
        first = (
            f"{job}: {t_ref:,.0f} s here, {'not done' if t_shoal is None else f'{t_shoal:,.0f} s'} in shoal"
        )
    return (
        f"| {label} | {r['jobs']:,} | {r['avg_ref'] / 3600:.4f} | {r['avg_shoal'] / 3600:.4f} | {diff:+.3f} % | "
        f"{r['same']:,} of {r['ref_completed']:,} | {first} |{cell}"
    )


HEADER = (
    "| {what} | jobs | avg JCT here (h) | avg JCT shoal (h) | shoal vs here | jobs ending at the same second "
    "| first job that differs |{extra}\n|---|---:|---:|---:|---:|---:|---|{extra_rule}"
)

VARIANTS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("count since restart (both defaults)", {}, {}),
    ("here: whole count, restarted job stays in Q1; shoal: default", {"since_restart": False}, {}),
    (
        "both: whole count (shoal `service_since_restart=False`)",
        {"since_restart": False},
        {"service_since_restart": False},
    ),
    ("here: demotion at the next arrival or completion; shoal: default", {"wake_at_crossing": False}, {}),
    ("here: queues by first start (shoal before issue 23); shoal: default", {"keep_lists": False}, {}),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vc", action="append", help=f"Philly VC[:N] (default: {', '.join(DEFAULT_VCS)})")
    parser.add_argument(
        "--sensitivity-vc", default="0e4a51", help="VC on which each one-rule variant is compared"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/reports/tiresias_reference.md")
    args = parser.parse_args(argv)
    from shoal.workloads import load_workload

    started = time.monotonic()
    rows = []
    cpu = {"here": 0.0, "shoal": 0.0}
    for vc in args.vc or DEFAULT_VCS:
        tjs = list(load_workload(f"philly:{vc}", seed=0))
        t0 = time.process_time()
        ref = simulate(tjs)
        t1 = time.process_time()
        got = shoal_run(tjs)
        cpu["here"] += t1 - t0
        cpu["shoal"] += time.process_time() - t1
        stored = stored_cell_avg(vc.split(":")[0]) if ":" not in vc else None
        r = agreement(tjs, ref, got)
        cell = (
            " — |"
            if stored is None
            else (" same |" if stored == r["avg_shoal"] else f" {stored / 3600:.4f} h |")
        )
        rows.append(_row(f"philly:{vc}", r, cell))
        print(rows[-1], flush=True)
    tjs = list(load_workload(f"philly:{args.sensitivity_vc}", seed=0))
    sensitivity = []
    for label, here, theirs in VARIANTS:
        sensitivity.append(_row(label, agreement(tjs, simulate(tjs, **here), shoal_run(tjs, **theirs))))
        print(sensitivity[-1], flush=True)
    command = "python benchmarks/tiresias_reference.py" + "".join(f" --vc {v}" for v in args.vc or [])
    if args.sensitivity_vc != "0e4a51":
        command += f" --sensitivity-vc {args.sensitivity_vc}"
    lines = [
        "# Tiresias-L against an independent implementation (issue 23, point 9)",
        "",
        f"Command: `{command}` (wall time {time.monotonic() - started:.0f} s; {platform.machine()}, Python "
        f"{platform.python_version()}). Every number below comes from that command.",
        "",
        "The second implementation (`simulate` in `benchmarks/tiresias_reference.py`) is a list-per-queue "
        "event loop, written apart from `shoal.policies.tiresias` and shoal's simulator, following the "
        "rules of `shared/REPRODUCTION.md` and AFS §5.1 the way the Tiresias authors' `dlas-gpu` code "
        "structures them (see its module docstring). Both run the same jobs (Philly VC, models drawn with "
        "seed 0) on the AFS reproduction's flat setting: 64 GPUs, free reconfigurations, completions and "
        "demotions rounded up to whole seconds. The last column compares shoal's average JCT with the "
        'stored flat Tiresias-L cell of `benchmarks/afs_reproduction.py` ("same": equal to the last bit).',
        "",
        "## Every job, every VC",
        "",
        HEADER.format(what="trace", extra=" AFS reproduction's cell |", extra_rule="---|"),
        *rows,
        "",
        f"CPU seconds for all of these: {cpu['here']:.1f} here, {cpu['shoal']:.1f} in shoal's simulator.",
        "",
        f"## Does the comparison notice a changed rule? (philly:{args.sensitivity_vc})",
        "",
        "Each row changes one rule on one side. A rule that mattered on this VC shows up as jobs ending at "
        "other times; the third row changes the same rule on both sides and agrees again.",
        "",
        HEADER.format(what="variant", extra="", extra_rule=""),
        *sensitivity,
        "",
    ]
    args.out.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

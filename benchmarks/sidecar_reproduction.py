"""Reproduce the shape of SideCar's Fig. 6 and Table VIII; writes benchmarks/reports/sidecar_reproduction.md.

    python benchmarks/sidecar_reproduction.py            # W1-W4, seeds 0-2 (a few minutes)
    python benchmarks/sidecar_reproduction.py --seeds 1  # one seed

Workloads like the paper's (§V.A; NOTES 4.3), generated with ``--seed``: a 16-GPU
cluster (the paper's two 8-GPU servers, as one pool: SideCar's algorithms count GPUs
only, NOTES 4.5 item 2), job types drawn uniformly from seven, arrivals exponential
within [0, 11000] s, each job declaring the optional counts {1, 2, 4, 8}:

* W1: 40 jobs of job set One (ResNet-8/18/34/50 types); W2: 20 jobs of set One;
* W3: 40 jobs of set Two (ResNet, Inception, VGG, GoogLeNet, AlexNet, LeNet types);
* W4: W3's jobs, but SideCar does not know their lengths: each stops at the accuracy it
  reaches in W3, and its remaining iterations are predicted from an accuracy curve fitted
  to noisy accuracy samples (:func:`shoal.profiling.accuracy.predict_total_iterations`,
  the offline profile's first points plus one sample per 500 iterations trained).

The job types' single-GPU run times and speedups are stand-ins shaped after the paper's
Table IV and Fig. 2 (1 → 2 GPUs 1.7×, 2 → 4 2.4× for ResNet-18 b64; speedup falls with
smaller batches and smaller models); the paper's own per-type profiles are not published.

Policies (``shoal simulate --policy ...`` runs each): ``sidecar`` (Algorithms 1–2,
early initialisation), ``sidecar-termination`` (reshaping up only, by terminate and
restart) and ``sidecar-default-k8s`` (a random optional count, fixed). Each is charged
its mechanism's costs by the one cost model (:mod:`shoal.sim.costs`), which SideCar's
and Termination's predictions use too: ``sidecar-paper`` for SideCar,
``termination-paper`` for the other two (the case study's numbers; Default-K8s never
reshapes, so it pays only the new-job init, the same 110 s). A second table charges
shoal's own trainer (``measured``) to all three.

Metrics: makespan, average JCT, and Table VIII's overhead = time spent removing and
adding GPUs (the nominal stop of every resize of a running job: ``charge`` without the
prepare-phase and early-initialisation credits) / total runtime of all jobs (first
start → completion, summed); also with the new jobs' initialisation added.
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from shoal import events as ev
from shoal.models import ThroughputCurve
from shoal.policies.base import ClusterView, Decision
from shoal.policies.registry import get_policy
from shoal.policies.sidecar import SideCarAdaptive, _Job, _Plan
from shoal.policies.tiresias import gang_size
from shoal.profiling.accuracy import predict_total_iterations
from shoal.sim.costs import ReconfigCosts, charge, classify, get_costs
from shoal.sim.engine import SimConfig, SimResult, Simulator
from shoal.workloads import TraceJob, make_job

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "reports" / "sidecar_reproduction.md"
GPUS = 16
OPTIONS = (1, 2, 4, 8)
POLICIES = ("sidecar", "sidecar-termination", "sidecar-default-k8s")
PAPER_COSTS = {
    "sidecar": "sidecar-paper",
    "sidecar-termination": "termination-paper",
    "sidecar-queue-aware": "sidecar-paper",
}
PAPER_COSTS_DEFAULT = "termination-paper"

# (name, single-GPU seconds for the job's epochs, speedup at 2, 4, 8 GPUs)
SET_ONE = (
    ("resnet18-b64", 6000.0, (1.7, 2.4, 2.9)),
    ("resnet18-b128", 5200.0, (1.8, 2.9, 4.0)),
    ("resnet18-b256", 4600.0, (1.9, 3.3, 5.1)),
    ("resnet34-b64", 9800.0, (1.7, 2.5, 3.2)),
    ("resnet34-b128", 8800.0, (1.8, 3.0, 4.4)),
    ("resnet50-b64", 13500.0, (1.8, 3.1, 4.7)),
    ("resnet8-cifar10-b1024", 2400.0, (1.4, 1.6, 1.6)),
)
SET_TWO = (
    ("resnet18-b256", 4600.0, (1.9, 3.3, 5.1)),
    ("resnet34-b128", 8800.0, (1.8, 3.0, 4.4)),
    ("inceptionv3-b128", 15000.0, (1.9, 3.4, 5.6)),
    ("vgg16-b64", 12000.0, (1.5, 2.0, 2.3)),
    ("googlenet-b512", 7000.0, (1.9, 3.5, 6.0)),
    ("alexnet-b256", 3000.0, (1.3, 1.5, 1.5)),
    ("lenet-mnist-b1024", 900.0, (1.1, 1.1, 1.0)),
)
WORKLOADS = {"W1": (SET_ONE, 40), "W2": (SET_ONE, 20), "W3": (SET_TWO, 40), "W4": (SET_TWO, 40)}
PAPER_FIG6 = {  # % reduction by SideCar (Fig. 6)
    "W1": (45, 17, 63, 27),
    "W2": (34, 20, 58, 37),
    "W3": (42, 17, 61, 35),
    "W4": (36, 18, 55, 36),
}
SHORTEN = (4.0, 16.0)
"""Factors by which the cause test divides the jobs' lengths and the arrival window."""
PAPER_TABLE8 = {"W1": (29.3, 8.9), "W2": (21.9, 6.7), "W3": (27.1, 7.6), "W4": (28.6, 8.3)}


def _curve(name: str, speedups: tuple[float, float, float]) -> ThroughputCurve:
    points = {1: 1.0, 2: speedups[0], 4: speedups[1], 8: speedups[2]}
    table = [0.0]
    for n in range(1, 9):
        lo = max(k for k in points if k <= n)
        hi = min(k for k in points if k >= n)
        table.append(
            points[lo] if lo == hi else points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        )
    return ThroughputCurve(model=name, throughput=tuple(table))


def workload(name: str, seed: int, shorten: float = 1.0) -> list[TraceJob]:
    """The jobs of workload ``name`` (W1-W4) for ``seed``; ``shorten`` divides both the
    jobs' lengths and the arrival window (the same load, with every fixed cost
    relatively ``shorten`` times larger)."""
    types, n = WORKLOADS[name]
    rng = random.Random(f"sidecar:{'W3' if name == 'W4' else name}:{seed}")
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    window = 11000.0 / shorten
    scale = window / sum(gaps)
    t = 0.0
    jobs = []
    for i in range(n):
        t += gaps[i] * scale
        tname, single_s, speedups = rng.choice(types)
        curve = _curve(tname, speedups)
        request = rng.choice(OPTIONS)
        at = float(math.floor(min(t, window)))
        duration = single_s / shorten / curve.throughput[request]
        jobs.append(make_job(f"{name.lower()}-{i:02d}", at, duration, request, curve))
    return jobs


class AccuracyPredicted:
    """W4: the policy sees each job's remaining iterations as predicted by the accuracy fit.

    Every job has a hidden accuracy curve ``acc(k) = b2 − 1/(b0·k + b1)`` (its type's,
    drawn per job); its target is the accuracy it reaches at its true length (what the
    same job reached in W3). The policy's view gets ``remaining_iterations`` = the fit of
    the points seen so far (the profile's points at 1, 5, 10, 20 iterations and a noisy
    sample every 500 iterations trained) minus the iterations done.
    """

    def __init__(self, policy: Any, jobs: list[TraceJob], seed: int) -> None:
        self.policy = policy
        self.name = policy.name
        self.elastic = getattr(policy, "elastic", True)
        self.seed = seed
        self.curves: dict[str, tuple[float, float, float]] = {}
        self.targets: dict[str, float] = {}
        self.errors: list[float] = []
        for j in jobs:
            rng = random.Random(f"acc:{seed}:{j.job_id}")
            total = j.spec.total_iterations or 1.0
            b2 = rng.uniform(0.80, 0.95)
            b0 = rng.uniform(2.0, 6.0) / total  # reaches near its plateau around its length
            b1 = 1.0 / (b2 - 0.005)
            self.curves[j.job_id] = (b0, b1, b2)
            self.targets[j.job_id] = b2 - 1.0 / (b0 * total + b1)

    def planning_costs(self) -> ReconfigCosts | None:
        fn = getattr(self.policy, "planning_costs", None)
        return fn() if callable(fn) else None

    def bind_costs(self, costs: ReconfigCosts) -> None:
        fn = getattr(self.policy, "bind_costs", None)
        if callable(fn):
            fn(costs)

    def _points(self, job_id: str, done: float) -> list[tuple[float, float]]:
        b0, b1, b2 = self.curves[job_id]
        rng = random.Random(f"noise:{self.seed}:{job_id}")
        pts = [(k, b2 - 1.0 / (b0 * k + b1)) for k in (1.0, 5.0, 10.0, 20.0)]
        k = 500.0
        while k <= done:
            pts.append((k, b2 - 1.0 / (b0 * k + b1) + rng.gauss(0.0, 0.004)))
            k += 500.0
        return pts

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        jobs = []
        for jv in view.jobs:
            predicted = predict_total_iterations(
                self._points(jv.job_id, jv.iterations_done), self.targets[jv.job_id]
            )
            if predicted is None or not math.isfinite(predicted):
                predicted = 2 * max(jv.iterations_done, 1.0)
            remaining = max(1.0, predicted - jv.iterations_done)
            if jv.remaining_iterations:
                self.errors.append(abs(remaining - jv.remaining_iterations) / jv.remaining_iterations)
            jobs.append(msgspec.structs.replace(jv, remaining_iterations=remaining))
        return self.policy.decide(msgspec.structs.replace(view, jobs=tuple(jobs)), memory)


class _QueuePlan(_Plan):
    """Algorithm 1 with ``MS_predict`` over the queued jobs too: cause (1) of the makespan
    gap to Termination, tested.

    Each option of the incoming job (idle GPUs alone, or with ``N_remove`` from one
    running job: here every such victim is tried) and waiting are keyed by the makespan
    and the sum of completions of a list schedule: the running jobs at their predicted
    finishes after the option, then the queued jobs (those left waiting ahead of this
    one, this one when it waits, those not yet decided behind it) in arrival order, each
    at its gang size (:func:`shoal.policies.tiresias.gang_size`), started when enough GPUs
    have freed, no one passing another. The ties are broken as :class:`_Plan` breaks
    them. Algorithm 2 is unchanged (it runs only when nothing is queued)."""

    def _schedule(self, running: list[tuple[float, int]], queue: list[_Job]) -> tuple[float, float]:
        total_gpus = self.idle + sum(r.share for r in self.running.values())
        free = total_gpus - sum(g for _, g in running)
        heap = list(running)
        heapq.heapify(heap)
        finishes = [f for f, _ in running]
        now = 0.0
        for q in queue:
            gang = gang_size(q.job)
            if gang > total_gpus:
                continue
            while free < gang and heap:
                t, g = heapq.heappop(heap)
                now, free = max(now, t), free + g
            f = now + self.finish(q, gang)
            heapq.heappush(heap, (f, gang))
            free -= gang
            finishes.append(f)
        return max(finishes, default=0.0), sum(finishes)

    def incoming(
        self, j: _Job, *, consider_waiting: bool, queued: tuple[Sequence[_Job], Sequence[_Job]] = ((), ())
    ) -> bool:
        ahead, behind = queued
        running = list(self.running.values())
        best: tuple[float, float, int, int, int] | None = None
        choice: tuple[int, _Job | None, int] = (0, None, 0)
        for n in j.counts:
            f_new = self.finish(j, n)
            if f_new == math.inf:
                continue
            nr = max(0, n - self.idle)
            victims: list[_Job | None] = (
                [None]
                if nr == 0
                else [
                    v
                    for v in running
                    if v.job.job_id not in self.used and v.job.elastic and v.share - nr in v.counts
                ]
            )
            for v in victims:
                after = [
                    (self.finish(r, r.share - nr), r.share - nr) if r is v else (r.finish, r.share)
                    for r in running
                ]
                ms, total = self._schedule([*after, (f_new, n)], [*ahead, *behind])
                key = (ms, total, 0, nr, -n)
                if best is None or key < best:
                    best, choice = key, (n, v, nr)
        if consider_waiting and best is not None:
            ms, total = self._schedule([(r.finish, r.share) for r in running], [*ahead, j, *behind])
            if (ms, total, 1, 0, -gang_size(j.job)) < best:
                return False
        if best is None:
            return False
        self.start(j, *choice)
        return True


class QueueAwareSideCar(SideCarAdaptive):
    """SideCar (Algorithms 1-2, early initialisation) whose ``MS_predict`` also counts the
    queued jobs (:class:`_QueuePlan`); the benchmark's test of cause (1), not a policy of
    the paper's."""

    name = "sidecar-queue-aware"
    plan_class = _QueuePlan


def run_one(wl: str, seed: int, policy_name: str, costs: str, shorten: float = 1.0) -> dict[str, Any]:
    jobs = workload(wl, seed, shorten)
    policy: Any = (
        get_policy(policy_name, seed=seed)
        if policy_name == "sidecar-default-k8s"
        else QueueAwareSideCar()
        if policy_name == QueueAwareSideCar.name
        else get_policy(policy_name)
    )
    wrapped = (
        AccuracyPredicted(policy, jobs, seed)
        if wl == "W4" and policy_name != "sidecar-default-k8s"
        else policy
    )
    cost_model = get_costs(costs)
    sim = Simulator(jobs, wrapped, SimConfig(total_gpus=GPUS, flat=True, costs=cost_model))
    result: SimResult = sim.run()
    first_start: dict[str, float] = {}
    adds = removes = 0
    resize_stop = 0.0
    world: dict[str, int] = {}
    for env in sim.log.envelopes:
        e = env.event
        if isinstance(e, ev.ReconfigurationCompleted):
            old = world.get(e.job_id, 0)
            if old == 0:
                first_start.setdefault(e.job_id, env.at - e.stop_time_s)
            elif e.world_size != old:
                # The resize's own stop (a restart's, not the equivalent stop that credits
                # early initialisation's overlap): charge() without rates.
                kind = classify(old, e.world_size, False)
                resize_stop += charge(cost_model, kind, old, e.world_size).stop_s if kind else 0.0
                adds += e.world_size > old
                removes += e.world_size < old
            world[e.job_id] = e.world_size
    done = {o.job_id: o for o in result.jobs}
    runtime = sum(
        o.completion_s - first_start.get(o.job_id, o.arrival_s)
        for o in done.values()
        if o.completion_s is not None
    )
    return {
        "makespan_s": result.summary["makespan_s"],
        "avg_jct_s": result.summary["avg_jct_s"],
        "overhead": resize_stop / runtime if runtime else 0.0,
        "overhead_init": (resize_stop + cost_model.start_s * len(first_start)) / runtime if runtime else 0.0,
        "adds": adds,
        "removes": removes,
        "completed": int(result.summary["completed"]),
        "jobs": len(jobs),
        "w4_error": statistics.median(wrapped.errors)
        if isinstance(wrapped, AccuracyPredicted) and wrapped.errors
        else None,
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per workload")
    p.add_argument("--out", type=Path, default=REPORT)
    args = p.parse_args()
    t0 = time.monotonic()
    seeds = list(range(args.seeds))
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for model in ("paper", "measured"):
        for wl in WORKLOADS:
            for pol in POLICIES:
                costs = (PAPER_COSTS.get(pol, PAPER_COSTS_DEFAULT)) if model == "paper" else "measured"
                rows = [run_one(wl, s, pol, costs) for s in seeds]
                results[(model, wl, pol)] = rows
                print(
                    f"{model:8} {wl} {pol:22} makespan {_mean(rows, 'makespan_s'):9.0f} s  avg JCT {_mean(rows, 'avg_jct_s'):8.0f} s",
                    flush=True,
                )
    # The causes of the makespan gap to Termination, tested: (2) shorter jobs, same load;
    # (1) SideCar with MS_predict over the queued jobs too, at every length.
    for shorten in (1.0, *SHORTEN):
        for wl in ("W1", "W3"):
            for pol in ("sidecar", "sidecar-termination", "sidecar-queue-aware"):
                if shorten == 1.0 and pol != "sidecar-queue-aware":
                    continue  # the main table's runs
                key = "paper" if shorten == 1.0 else f"paper/{shorten:g}"
                rows = [run_one(wl, s, pol, PAPER_COSTS[pol], shorten) for s in seeds]
                results[(key, wl, pol)] = rows
                print(
                    f"shorten {shorten:g} {wl} {pol:22} makespan {_mean(rows, 'makespan_s'):9.0f} s",
                    flush=True,
                )
    text = render(results, seeds, time.monotonic() - t0, args)
    args.out.write_text(text)
    print(text)


def _red(base: float, x: float) -> str:
    return f"{(1 - x / base) * 100:.0f}" if base else "n/a"


def render(
    results: dict[tuple[str, str, str], list[dict[str, Any]]],
    seeds: list[int],
    elapsed: float,
    args: argparse.Namespace,
) -> str:
    cmd = "python benchmarks/sidecar_reproduction.py" + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
    lines = [
        "# SideCar reproduction: Fig. 6 and Table VIII (shape)",
        "",
        f"Generated by `{cmd}` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC ({platform.machine()}, "
        f"{os.cpu_count()} CPUs; {elapsed:.0f} s). Every number below comes from this run: the simulator "
        f"(`shoal simulate --flat --gpus {GPUS} --policy <policy> --costs <costs>` runs the same cells on its own "
        f"traces), seeds {', '.join(map(str, seeds))} per workload, means over the seeds.",
        "",
        "Workloads, policies, costs and metrics: see the docstring of `benchmarks/sidecar_reproduction.py`. "
        "In short: 16 GPUs, W1/W2/W3 = 40/20/40 jobs with optional counts {1, 2, 4, 8} arriving exponentially "
        "within [0, 11000] s; W4 = W3's jobs whose lengths SideCar predicts from a fitted accuracy curve "
        "(Termination's predictions use the same fit; Default-K8s needs none).",
        "",
    ]
    for model, title in (
        (
            "paper",
            "Costs of the paper's mechanisms (`sidecar-paper` for SideCar, `termination-paper` for the baselines)",
        ),
        ("measured", "shoal's own trainer for every policy (`measured`)"),
    ):
        lines += [
            f"## {title}",
            "",
            "| workload | policy | makespan (s) | avg JCT (s) | overhead | add events | remove events |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for wl in WORKLOADS:
            for pol in POLICIES:
                rows = results[(model, wl, pol)]
                lines.append(
                    f"| {wl} | {pol} | {_mean(rows, 'makespan_s'):,.0f} | {_mean(rows, 'avg_jct_s'):,.0f} | "
                    f"{_mean(rows, 'overhead') * 100:.1f}% | {_mean(rows, 'adds'):.1f} | {_mean(rows, 'removes'):.1f} |"
                )
        lines += [
            "",
            "Fig. 6: reduction by SideCar, % (this run / paper):",
            "",
            "| workload | makespan vs Default-K8s | makespan vs Termination | avg JCT vs Default-K8s | avg JCT vs Termination |",
            "|---|---:|---:|---:|---:|",
        ]
        for wl in WORKLOADS:
            sc = results[(model, wl, "sidecar")]
            te = results[(model, wl, "sidecar-termination")]
            de = results[(model, wl, "sidecar-default-k8s")]
            pm = PAPER_FIG6[wl]
            cells = [
                (_red(_mean(de, "makespan_s"), _mean(sc, "makespan_s")), pm[0]),
                (_red(_mean(te, "makespan_s"), _mean(sc, "makespan_s")), pm[1]),
                (_red(_mean(de, "avg_jct_s"), _mean(sc, "avg_jct_s")), pm[2]),
                (_red(_mean(te, "avg_jct_s"), _mean(sc, "avg_jct_s")), pm[3]),
            ]
            lines.append(f"| {wl} | " + " | ".join(f"{a} / {b}" for a, b in cells) + " |")
        lines += [
            "",
            "Table VIII: overhead = resize stop time / total runtime, % (this run / paper):",
            "",
            "| | " + " | ".join(WORKLOADS) + " | average |",
            "|---|" + "---:|" * (len(WORKLOADS) + 1),
        ]
        for pol, idx, label in (("sidecar-termination", 0, "Termination"), ("sidecar", 1, "SideCar")):
            vals = [_mean(results[(model, wl, pol)], "overhead") * 100 for wl in WORKLOADS]
            paper = [PAPER_TABLE8[wl][idx] for wl in WORKLOADS]
            lines.append(
                f"| {label} | "
                + " | ".join(f"{v:.1f} / {pv}" for v, pv in zip(vals, paper, strict=True))
                + f" | {statistics.fmean(vals):.1f} / {statistics.fmean(paper):.1f} |"
            )
        lines.append("")
        lines.append(
            "With the new jobs' initialisation counted as overhead too (Termination / SideCar, average over "
            "the workloads): "
            f"{statistics.fmean(_mean(results[(model, wl, 'sidecar-termination')], 'overhead_init') for wl in WORKLOADS) * 100:.1f}% / "
            f"{statistics.fmean(_mean(results[(model, wl, 'sidecar')], 'overhead_init') for wl in WORKLOADS) * 100:.1f}%."
        )
        w4 = [r["w4_error"] for r in results[(model, "W4", "sidecar")] if r["w4_error"] is not None]
        if w4:
            lines += [
                "",
                f"W4: median relative error of SideCar's predicted remaining iterations over its decisions: {statistics.fmean(w4) * 100:.0f}% (mean over seeds).",
            ]
        lines.append("")
    lines += [
        "## Testing the makespan gap to Termination: shorter jobs, and MS_predict over the queue",
        "",
        "W1 and W3 with the paper's mechanisms' costs, every job's length and the arrival window divided by "
        "the factor (so the load is the same and each fixed cost, the termination restart's 223 s among "
        "them, weighs that many times more). Rows `sidecar`: the policy as the paper describes it, whose "
        "MS_predict counts the running jobs and the incoming one; rows `queue-aware`: the same Algorithms "
        "1-2 with MS_predict over the queued jobs too (`QueueAwareSideCar` of this benchmark, a test of "
        "cause (1) below, not a policy of the paper's). Reduction of makespan and average JCT against "
        "Termination, %:",
        "",
        "| workload | MS_predict | "
        + " | ".join(f"÷{f:g} makespan | ÷{f:g} avg JCT" for f in (1.0, *SHORTEN))
        + " |",
        "|---|---|" + "---:|" * (2 * (1 + len(SHORTEN))),
    ]
    for wl in ("W1", "W3"):
        for pol, label in (("sidecar", "sidecar"), ("sidecar-queue-aware", "queue-aware")):
            reductions: list[str] = []
            for key in ("paper", *(f"paper/{f:g}" for f in SHORTEN)):
                sc, te = results[(key, wl, pol)], results[(key, wl, "sidecar-termination")]
                reductions += [
                    _red(_mean(te, "makespan_s"), _mean(sc, "makespan_s")),
                    _red(_mean(te, "avg_jct_s"), _mean(sc, "avg_jct_s")),
                ]
            lines.append(f"| {wl} | {label} | " + " | ".join(reductions) + " |")
    lines.append("")
    lines += _discussion(results)
    return "\n".join(lines) + "\n"


def _range(results: dict[tuple[str, str, str], list[dict[str, Any]]], base: str, key: str) -> str:
    vals = [
        (1 - _mean(results[("paper", wl, "sidecar")], key) / _mean(results[("paper", wl, base)], key)) * 100
        for wl in WORKLOADS
    ]
    return f"{min(vals):.0f} to {max(vals):.0f} %"


def _shortened(
    results: dict[tuple[str, str, str], list[dict[str, Any]]],
    pol: str = "sidecar",
    factors: tuple[float, ...] = SHORTEN,
) -> str:
    vals = [
        (
            1
            - _mean(results[(_key(f), wl, pol)], "makespan_s")
            / _mean(results[(_key(f), wl, "sidecar-termination")], "makespan_s")
        )
        * 100
        for f in factors
        for wl in ("W1", "W3")
    ]
    low, high = f"{min(vals):.0f}", f"{max(vals):.0f}"
    return f"{low} %" if low == high else f"{low} to {high} %"


def _key(factor: float) -> str:
    return "paper" if factor == 1.0 else f"paper/{factor:g}"


def _shortened_trend(results: dict[tuple[str, str, str], list[dict[str, Any]]]) -> str:
    """Whether the shortest jobs moved SideCar's makespan reduction up in every workload."""

    def red(key: str, wl: str) -> float:
        base = _mean(results[(key, wl, "sidecar-termination")], "makespan_s")
        return 1 - _mean(results[(key, wl, "sidecar")], "makespan_s") / base

    last = f"paper/{SHORTEN[-1]:g}"
    if all(red(last, wl) > red("paper", wl) for wl in ("W1", "W3")):
        return "shorter jobs move it in SideCar's favour in both workloads"
    return "shorter jobs do not move it in SideCar's favour in both workloads"


def _discussion(results: dict[tuple[str, str, str], list[dict[str, Any]]]) -> list[str]:
    """Where the paper's numbers are not reached, and why (the ranges are this run's)."""
    return [
        "## Where the paper's numbers are not reached, and why",
        "",
        f"* **Against Default-K8s** SideCar's reduction is {_range(results, 'sidecar-default-k8s', 'makespan_s')} "
        f"in makespan and {_range(results, 'sidecar-default-k8s', 'avg_jct_s')} in average JCT (paper 34-45 % and "
        "55-63 %). The paper's Default-K8s also lost GPUs to Kubernetes itself: 8 GPUs idle from the start "
        "until t2 and 12 of 16 in use while an 8-GPU job waited (Fig. 10), from the device plugin and the "
        "two hosts. Here the baseline is the policy alone on a 16-GPU pool, so only its random fixed "
        "counts and queueing cost it.",
        f"* **Against Termination** SideCar's average JCT is {_range(results, 'sidecar-termination', 'avg_jct_s')} "
        f"lower (paper 27-37 %), but its makespan reduction is {_range(results, 'sidecar-termination', 'makespan_s')} "
        "(negative: longer; paper 17-20 %). Two causes, each tested in the table above. (1) SideCar's "
        "MS_predict counts the running jobs and the incoming one, not the queued ones (the paper leaves this "
        "open; NOTES 4.5 item 1). So Algorithm 1 gives an incoming job the count that finishes it soonest, "
        "while Termination starts every job on one GPU, where these sublinear curves give the best rate per "
        "GPU. With MS_predict over the queue too, the reduction at full length is "
        f"{_shortened(results, 'sidecar-queue-aware', (1.0,))}, and with the jobs "
        f"{SHORTEN[-1]:g} times shorter (both causes removed) "
        f"{_shortened(results, 'sidecar-queue-aware', (SHORTEN[-1],))}, against the paper's 17-20 %. The "
        "paper does not say which MS_predict it used, so the `sidecar` policy keeps the reading of its "
        "text. (2) The stand-in jobs "
        "need 15 min to 4 h on one GPU, so a 223 s "
        "termination restart costs Termination little, where the paper's jobs were short next to their "
        "Kubernetes overheads (the case study's 1-epoch jobs ran 633 s and 442 s). Tested above: with the "
        f"jobs and the arrival window {' and '.join(f'{f:g}' for f in SHORTEN)} times shorter, SideCar's "
        f"makespan reduction against Termination is {_shortened(results)} "
        f"({_shortened_trend(results)}), so job length alone does not open the paper's 17-20 % gap.",
        "* **Table VIII.** Here the overhead is the stop of each resize over the jobs' run time. The paper "
        "does not say exactly what its 26.7 % and 7.9 % count, and its jobs were short next to its restart "
        "costs, so the levels differ. With the paper's mechanisms, compare the order of Termination and "
        "SideCar in each workload and the event counts with Fig. 11 (W1: Termination 46 adds and 0 removes, "
        "SideCar 16 adds). With shoal's own trainer every resize is in place, and stops of milliseconds show "
        "as 0.0 %.",
        "* **W4.** The hidden accuracy curves have the fitted form, so the fit predicts lengths within a few "
        "per cent (the error above) and W4 stays close to W3. In the paper W4 gained less than W3 because "
        "it mispredicted epochs. Real accuracy curves do not follow the fitted form exactly; that loss is "
        "not reproduced here.",
        "* **Not modelled:** GPU types and hosts (V100/P100/K80; SideCar's algorithms count GPUs, NOTES 4.5 "
        "item 2), the paper's per-type profiles (not published; the stand-ins follow Table IV and Fig. 2), and "
        "the cross-host restart (every job fits one 8-GPU host).",
        "",
    ]


if __name__ == "__main__":
    main()

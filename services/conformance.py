"""Emulate vs simulate: one trace slice through the live stack and through the simulator.

Both runs take the same jobs (calibrated curves, model assignment by seed), policy,
cluster (nodes × GPUs per node, network packing, min-migration placement) and cost
model. The simulator runs in virtual time; the emulated stack runs admission,
allocator, placer and node daemons on a real nats-server with one sidecar
subprocess per job and node, at ``time_scale`` virtual seconds per wall second.

What is compared:

* average JCT (and makespan) of the two runs, from each run's own log;
* the sequences of share decisions: the distinct successive ``SharesDecided`` share
  maps of each log (epochs renumbered away, since the emulated allocator also skips
  unchanged decisions), their longest common subsequence over the longer length
  (``decision_agreement``), and whether the decisions triggered by arrivals agree
  one for one (``arrivals_agree``).

Why the two can differ at all. On a free-running clock (``synchronized=False``),
control-plane latency is virtual time: arrivals are stamped with their trace instant
and orders apply as of their decision instant (see
``services/trainer_sidecar/emulated.py`` and the allocator's docstring), so latency
does not move a job's progress, but the pipeline — completion → allocator → placer
→ node daemon → sidecar, 10–20 ms on two cores, more during a burst — still races
the next event: at 1500× 15 ms is 22 virtual seconds. A job that completes within
that time of the decision that changed its share completes under the old one; two
completions closer than that reach the allocator as one burst; and the placer,
which places only the newest decision, skips one that was superseded before it got
to it. The JCT is robust to that; the decision sequence less so.

The synchronized clock (``synchronized=True``, the default here;
:class:`shoal.clock.SharedClock`) removes that race: virtual time stands still from
an event until every order it caused has been applied, and cannot pass the next
known event (arrival, completion, periodic decision) before it has happened. The
emulated run then makes the simulator's decisions one for one at any time scale.
What is left is rounding: a job's progress is handed from one leading sidecar to
the next in whole iterations (``ProgressReported.iteration``), so a job whose
leading sidecar moves can finish a second later than in the simulator (completions
are rounded up to whole seconds), and the decision its completion triggers — the
same share map — comes a second later too.

Throughput knowledge (``profiling``). ``oracle`` (default): the simulator publishes
every job's curve at arrival and the emulated run submits it as the job's profile.
``overestimate``: AFS §4.5 on both sides. The simulator runs with
``SimConfig(profiling="overestimate", measure_s=measure_s)``. The emulated stack also
runs the profiler (``min_interval_s=measure_s``, its measurement window), its
allocator is given no catalog and the jobs no profile, so every job starts on the
estimate: capped at 1/n, then taken through its smaller allocatable units as the
profiler's measurements of the emulated trainers arrive (``decide_overestimate_first``
in the allocator). On the synchronized clock the allocator and profiler hold the clock
at the end of each measurement window (see the profiler's docstring), so measurements
land at the simulator's instants. Two choices make the sides comparable: both run
each job at its ``afs`` catalog curve (what an emulated trainer runs at without a
profile; the trace's per-job calibration differs from it by up to about 1 %), and the
profiler's Optimus fit is off (``fit_min_counts`` out of reach), because the simulator
publishes the §4.5 estimate of the measured counts only, never a fit. ``compare``
also counts the §4.5 models of each log and the decisions they triggered, and names
the first decision where the sequences differ.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from shoal import events as ev
from shoal.bus import Bus
from shoal.models import get_catalog
from shoal.nats_server import EmbeddedNats
from shoal.policies.base import Policy
from shoal.profiling import OVERESTIMATE_KIND, ProfileParams
from shoal.profiling.ratelimit import MIN_INTERVAL_S
from shoal.sim.costs import get_costs
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.state import fold
from shoal.workloads import TraceJob, load_workload
from shoal_services.stack import EmulatedStack, StackConfig, replay_trace, summarize

STACK_CATALOG = "afs"
"""The emulated stack's catalog (the trainers' curves for a job without a profile)."""

PROFILING_MODES = ("oracle", "overestimate")

NO_FIT = 1 << 30
"""``ProfileParams.fit_min_counts`` that no job reaches."""


CONFORMANCE_HOLD_TTL_S = 120.0
"""A conformance run's hand-over holds live this long unreleased (the default, 10 s, is
for an emulated installation that must run on after a lost message). Nothing is lost in
such a run, but on a loaded 2-core machine (load average 20-30) a sidecar took over 10 s
to apply an order: the hold lapsed, virtual time ran on past the instant the simulator
decides at, and the one-for-one check failed (``clock_hold_lapsed`` in the log)."""


class ConformanceConfig(msgspec.Struct, frozen=True, kw_only=True):
    trace: str = "philly:0e4a51:12"
    policy: str = "afs-p"
    seed: int = 0
    nodes: int = 4
    gpus_per_node: int = 4
    gpu_type: str = "V100"
    costs: str = "coddl"
    time_scale: float = 1000.0
    report_every_s: float = 0.5
    synchronized: bool = True
    """Run the emulated stack on a synchronized clock (see :class:`shoal.clock.SharedClock`)."""
    hold_ttl_s: float = CONFORMANCE_HOLD_TTL_S
    """How long a hand-over hold of the synchronized clock lives unreleased (wall s)."""
    profiling: str = "oracle"
    """``oracle``: every job's curve is known at arrival (the simulator publishes it, the
    emulated run submits it as the job's profile). ``overestimate``: AFS §4.5 runs on
    both sides (see the module docstring)."""
    measure_s: float = MIN_INTERVAL_S
    """``overestimate``: the simulator's ``measure_s`` and the live profiler's
    ``min_interval_s``, virtual seconds."""

    def __post_init__(self) -> None:
        if self.profiling not in PROFILING_MODES:
            raise ValueError(f"profiling is one of {', '.join(PROFILING_MODES)}; got {self.profiling!r}")
        if self.profiling == "overestimate" and not self.measure_s > 0:
            raise ValueError(f"measure_s must be positive, got {self.measure_s}")


def share_sequence(envs: Sequence[ev.Envelope], trigger: str | None = None) -> list[dict[str, int]]:
    """The distinct successive share maps of a log (epochs renumbered away); with
    ``trigger``, only the decisions that trigger caused (:func:`decision_trail`)."""
    return [shares for _, cause, shares in decision_trail(envs) if trigger is None or cause == trigger]


def decision_trail(envs: Sequence[ev.Envelope]) -> list[tuple[float, str, dict[str, int]]]:
    """(virtual instant, trigger, shares) of each distinct successive share map of a log.

    Of several decisions stamped with the same virtual instant only the last counts:
    the others were in force for no virtual time (the emulated allocator decided on
    part of a same-instant burst, then on all of it) and cannot change any job's
    progress. A decision that only drops jobs that finished since the one before
    (the others keep their shares) is not counted either: the completion already
    said so, and the allocator does not publish a decision that changes nothing it
    holds (the simulator records every one).
    """
    decisions: list[tuple[float, ev.SharesDecided, frozenset[str]]] = []
    finished: set[str] = set()
    for env in envs:
        e = env.event
        if isinstance(e, ev.JobCompleted | ev.JobFailed | ev.JobCancelled):
            finished.add(e.job_id)
        elif isinstance(e, ev.SharesDecided):
            if decisions and abs(decisions[-1][0] - env.at) < 1e-6:
                decisions.pop()
            decisions.append((env.at, e, frozenset(finished)))
    out: list[tuple[float, str, dict[str, int]]] = []
    last: dict[str, int] = {}
    for at, event, done in decisions:
        shares = dict(event.shares)
        implied = {j: s for j, s in last.items() if j not in done}
        if shares != implied:
            out.append((at, event.trigger, shares))
        last = shares
    return out


def arrival_difference(
    sim_envs: Sequence[ev.Envelope], emu_envs: Sequence[ev.Envelope]
) -> dict[str, Any] | None:
    """Where the arrival-triggered decisions of the two logs first differ, with what
    locates it: the index among arrival decisions, each side's (instant, trigger) there,
    and the (instant, trigger) of every decision of the other side with the same shares
    (the same decision labelled with another trigger shows up there). None if equal."""
    a, b = decision_trail(sim_envs), decision_trail(emu_envs)
    arr_a = [d for d in a if d[1] == "arrival"]
    arr_b = [d for d in b if d[1] == "arrival"]
    for i in range(max(len(arr_a), len(arr_b))):
        x = arr_a[i] if i < len(arr_a) else None
        y = arr_b[i] if i < len(arr_b) else None
        if x is None or y is None or x[2] != y[2]:
            return {
                "index": i,
                "sim": None if x is None else (x[0], x[1]),
                "emu": None if y is None else (y[0], y[1]),
                "sim_shares_in_emu": [] if x is None else [(at, t) for at, t, sh in b if sh == x[2]],
                "emu_shares_in_sim": [] if y is None else [(at, t) for at, t, sh in a if sh == y[2]],
            }
    return None


def sequence_agreement(a: Sequence[dict[str, int]], b: Sequence[dict[str, int]]) -> float:
    """Longest common subsequence of two decision sequences over the longer length."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b):
            cur[j + 1] = prev[j] + 1 if x == y else max(prev[j + 1], cur[j])
        prev = cur
    return prev[len(b)] / max(len(a), len(b))


def model_updates(envs: Sequence[ev.Envelope]) -> int:
    """``ThroughputModelUpdated`` events of AFS §4.5's estimate in a log (one per newly
    measured GPU count of a job)."""
    return sum(
        1
        for env in envs
        if isinstance(env.event, ev.ThroughputModelUpdated) and env.event.model_kind == OVERESTIMATE_KIND
    )


def first_difference(
    a: Sequence[dict[str, int]], b: Sequence[dict[str, int]]
) -> tuple[int, dict[str, int], dict[str, int]] | None:
    """The first position where two decision sequences differ, with the shares that
    differ there (job -> GPUs, 0 for a job absent from one side); ``None`` if equal."""
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else {}
        y = b[i] if i < len(b) else {}
        if x != y or i >= len(a) or i >= len(b):
            keys = sorted(set(x) | set(y))
            return (
                i,
                {k: x.get(k, 0) for k in keys if x.get(k, 0) != y.get(k, 0)},
                {k: y.get(k, 0) for k in keys if x.get(k, 0) != y.get(k, 0)},
            )
    return None


def load_jobs(cfg: ConformanceConfig) -> tuple[TraceJob, ...]:
    """The slice, with arrivals shifted to start at 0 (as the stack replays them).

    With ``profiling="overestimate"`` each job's curve is its model's catalog curve
    (the ``afs`` catalog, which the emulated trainers run at when no profile tells them
    otherwise) instead of the trace's per-job calibration of it (up to about 1 % away from it).
    """
    jobs = load_workload(cfg.trace, seed=cfg.seed)
    t0 = jobs[0].submit_time_s if jobs else 0.0
    if cfg.profiling == "overestimate":
        catalog = get_catalog(STACK_CATALOG)
        jobs = tuple(
            msgspec.structs.replace(j, throughput=catalog.curve(j.spec.model, "").throughput) for j in jobs
        )
    return tuple(msgspec.structs.replace(j, submit_time_s=j.submit_time_s - t0) for j in jobs)


def run_sim(
    jobs: Sequence[TraceJob], policy: Policy, cfg: ConformanceConfig
) -> tuple[dict[str, float], list[ev.Envelope]]:
    sim_cfg = SimConfig(
        total_gpus=cfg.nodes * cfg.gpus_per_node,
        gpus_per_node=cfg.gpus_per_node,
        costs=get_costs(cfg.costs),
        gpu_type=cfg.gpu_type,
        profiling=cfg.profiling,
        measure_s=cfg.measure_s,
    )
    sim = Simulator(jobs, policy, sim_cfg)
    result = sim.run()
    return result.summary, list(sim.log.envelopes)


async def run_emulated(
    jobs: Sequence[TraceJob],
    policy: Policy,
    cfg: ConformanceConfig,
    nats_url: str | None = None,
    creds: str | None = None,
) -> tuple[dict[str, float], list[ev.Envelope], float]:
    """Replay ``jobs`` through the emulated stack, as the admin (``creds``). Without
    ``nats_url`` an embedded server with a temporary store and authentication on is
    started (and stopped)."""
    server: EmbeddedNats | None = None
    overestimate = cfg.profiling == "overestimate"
    with tempfile.TemporaryDirectory() as tmp:
        if nats_url is None:
            server = EmbeddedNats(store_dir=Path(tmp) / "js", creds_dir=Path(tmp) / "creds", prefix="*")
            creds = server.admin_creds()
            server.start()
            nats_url = server.url
        try:
            bus = await Bus.connect(nats_url, prefix=f"conf{time.time_ns() % 10**12}", creds=creds)
            try:
                await bus.declare()
                stack = EmulatedStack(
                    bus,
                    nats_url,
                    policy,
                    StackConfig(
                        nodes=cfg.nodes,
                        gpus_per_node=cfg.gpus_per_node,
                        gpu_type=cfg.gpu_type,
                        time_scale=cfg.time_scale,
                        costs=cfg.costs,
                        report_every_s=cfg.report_every_s,
                        # A node hosts at most one job per GPU: with that many spares
                        # no job placed there waits for a sidecar's cold start.
                        spares=cfg.gpus_per_node,
                        synchronized=cfg.synchronized,
                        hold_ttl_s=cfg.hold_ttl_s,
                        catalog=STACK_CATALOG,
                        profiler=overestimate,
                        profiler_min_interval_s=cfg.measure_s,
                        # The simulator publishes §4.5's estimate of the measured counts
                        # only, never a fit: the profiler's Optimus fit is left out.
                        profiler_params=ProfileParams(fit_min_counts=NO_FIT),
                        allocator_catalog=not overestimate,
                    ),
                    creds=creds,
                )
                await stack.start()
                t0 = time.monotonic()
                try:
                    await replay_trace(stack, jobs, attach_profiles=not overestimate)
                finally:
                    await stack.stop()
                wall = time.monotonic() - t0
                envs = [env async for _, env in bus.replay()]
            finally:
                await bus.close()
        finally:
            if server is not None:
                server.stop()
    state = fold(envs)
    return summarize(state, [j.job_id for j in jobs], cfg.nodes * cfg.gpus_per_node), envs, wall


def compare(cfg: ConformanceConfig, nats_url: str | None = None, creds: str | None = None) -> dict[str, Any]:
    """Run both modes on ``cfg`` and compare them (see the module docstring); ``creds``:
    the admin's seed file for ``nats_url``."""
    jobs = load_jobs(cfg)
    sim_summary, sim_envs = run_sim(jobs, make_policy(cfg.policy, seed=cfg.seed), cfg)
    emu_summary, emu_envs, wall = asyncio.run(
        run_emulated(jobs, make_policy(cfg.policy, seed=cfg.seed), cfg, nats_url, creds)
    )
    a, b = share_sequence(sim_envs), share_sequence(emu_envs)
    arr_a, arr_b = share_sequence(sim_envs, "arrival"), share_sequence(emu_envs, "arrival")
    diff = first_difference(a, b)
    return {
        "trace": cfg.trace,
        "policy": cfg.policy,
        "profiling": cfg.profiling,
        "measure_s": cfg.measure_s,
        "time_scale": cfg.time_scale,
        "synchronized": cfg.synchronized,
        "jobs": len(jobs),
        "sim_completed": sim_summary["completed"],
        "emu_completed": emu_summary["completed"],
        "sim_avg_jct_s": sim_summary["avg_jct_s"],
        "emu_avg_jct_s": emu_summary["avg_jct_s"],
        "jct_rel_diff": abs(emu_summary["avg_jct_s"] - sim_summary["avg_jct_s"]) / sim_summary["avg_jct_s"],
        "sim_makespan_s": sim_summary["makespan_s"],
        "emu_makespan_s": emu_summary["makespan_s"],
        "sim_decisions": len(a),
        "emu_decisions": len(b),
        "decision_agreement": sequence_agreement(a, b),
        "arrival_decisions": len(arr_a),
        "arrivals_agree": arr_a == arr_b,
        "arrival_difference": None if arr_a == arr_b else arrival_difference(sim_envs, emu_envs),
        "sim_model_updates": model_updates(sim_envs),
        "emu_model_updates": model_updates(emu_envs),
        "sim_probe_decisions": len(share_sequence(sim_envs, "model_update")),
        "emu_probe_decisions": len(share_sequence(emu_envs, "model_update")),
        "first_difference": diff,
        "wall_s": wall,
    }

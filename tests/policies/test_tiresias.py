"""Tiresias-L: queue demotion at the threshold, FCFS, backfill, restarts, and properties.

The helpers at the top (``job``, ``views``, ``next_view``, ``assert_pure``) are shared
by the other baseline policies' tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.models import ThroughputCurve
from shoal.policies.base import ClusterView, Decision, JobView, Policy, check_decision, feasible_counts
from shoal.policies.tiresias import TiresiasL, gang_size
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import TraceJob, load_workload, make_job

from tests.policies.checked import run_checked

# ---------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------


def job(job_id: str, **kw: Any) -> JobView:
    """A job view with a linear curve up to ``max_gpus`` unless given."""
    max_gpus = kw.get("max_gpus", max(1, kw.get("requested_gpus", 1)))
    kw.setdefault("max_gpus", max_gpus)
    kw.setdefault("throughput", tuple(float(k) for k in range(max_gpus + 1)))
    return JobView(job_id=job_id, **kw)


def view(now: float, total: int, *jobs: JobView) -> ClusterView:
    return ClusterView(now_s=now, total_gpus=total, jobs=tuple(jobs))


@hs.composite
def job_views(draw: hs.DrawFn, job_id: str, now: float) -> JobView:
    max_gpus = draw(hs.integers(1, 8))
    min_gpus = draw(hs.integers(1, max_gpus))
    requested = draw(hs.integers(1, 8))
    elastic = draw(hs.booleans())
    allowed = draw(hs.none() | hs.lists(hs.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4))
    # Concave-ish curve: per-step gains that shrink, sometimes negative at the end.
    gains = draw(hs.lists(hs.floats(0.0, 1.0), min_size=max_gpus, max_size=max_gpus))
    curve = [0.0]
    step = 1.0
    for g in gains:
        curve.append(curve[-1] + step * (0.2 + g))
        step *= 0.8
    if draw(hs.booleans()):
        curve[-1] = curve[-2] * 0.95 if len(curve) > 2 else curve[-1]
    remaining = draw(hs.none() | hs.floats(1.0, 1e6))
    return JobView(
        job_id=job_id,
        arrival_s=draw(hs.floats(0.0, now)),
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        requested_gpus=requested,
        elastic=elastic,
        allowed_gpu_counts=tuple(sorted(set(allowed))) if allowed else None,
        throughput=tuple(curve),
        remaining_iterations=remaining,
        total_iterations=None if remaining is None else remaining + draw(hs.floats(0.0, 1e5)),
        attained_service_gpu_s=draw(hs.floats(0.0, 400_000.0)),
        current_gpus=0,
    )


@hs.composite
def views(draw: hs.DrawFn, max_jobs: int = 12) -> ClusterView:
    """Random clusters with a feasible current allocation."""
    now = draw(hs.floats(0.0, 1e6))
    total = draw(hs.integers(0, 24))
    n = draw(hs.integers(0, max_jobs))
    jobs = [draw(job_views(f"j{i}", now)) for i in range(n)]
    free = total
    placed = []
    for j in jobs:
        counts = [c for c in feasible_counts(j) if c <= free]
        running = bool(counts) and draw(hs.booleans())
        if running:
            c = draw(hs.sampled_from(counts))
            free -= c
            j = msgspec.structs.replace(j, current_gpus=c)
        placed.append(j)
    return ClusterView(now_s=now, total_gpus=total, jobs=tuple(placed))


def next_view(v: ClusterView, decision: Decision, dt: float) -> ClusterView:
    """The view ``dt`` seconds later if the decision ran as decided (no completion)."""
    jobs = []
    for j in v.jobs:
        g = decision.shares.get(j.job_id, 0)
        rate = j.throughput[g] if g < len(j.throughput) else j.throughput[-1]
        remaining = None if j.remaining_iterations is None else max(1.0, j.remaining_iterations - rate * dt)
        jobs.append(
            msgspec.structs.replace(
                j,
                current_gpus=g,
                attained_service_gpu_s=j.attained_service_gpu_s + g * dt,
                remaining_iterations=remaining,
                iterations_done=j.iterations_done + rate * dt,
            )
        )
    return ClusterView(now_s=v.now_s + dt, total_gpus=v.total_gpus, jobs=tuple(jobs))


def assert_pure(policy: Policy, v: ClusterView, memory: Mapping[str, Any] | None = None) -> Decision:
    """Feasible, deterministic, and the memory survives msgpack with the same next decision."""
    memory = memory or {}
    d1 = policy.decide(v, memory)
    check_decision(v, d1)
    d2 = policy.decide(v, memory)
    assert d1 == d2
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(d1.memory))
    assert wire == d1.memory
    nv = next_view(v, d1, 137.0)
    a = policy.decide(nv, d1.memory)
    b = policy.decide(nv, wire)
    check_decision(nv, a)
    assert a == b
    return d1


# ---------------------------------------------------------------------------
# Tiresias-L
# ---------------------------------------------------------------------------


def test_gang_size_is_the_request_when_feasible() -> None:
    assert gang_size(job("a", requested_gpus=4, max_gpus=8)) == 4
    assert gang_size(job("a", requested_gpus=3, max_gpus=8, allowed_gpu_counts=(1, 2, 4))) == 2
    assert gang_size(job("a", requested_gpus=1, min_gpus=2, max_gpus=8)) == 2
    assert gang_size(job("a", requested_gpus=2, max_gpus=8, elastic=False)) == 2


def test_demotion_at_the_threshold_lets_the_newer_job_run() -> None:
    policy = TiresiasL(queue_thresholds_gpu_s=(1000.0,))
    old = job(
        "old", arrival_s=0.0, requested_gpus=2, max_gpus=2, current_gpus=2, attained_service_gpu_s=999.0
    )
    new = job("new", arrival_s=10.0, requested_gpus=2, max_gpus=2)
    # Just below the threshold: FCFS inside Q0, the old job keeps the GPUs.
    d = policy.decide(view(500.0, 2, old, new), {"jobs": {"old": [0.0, 0.0, -1.0]}})
    assert d.shares == {"old": 2}
    # It asks to be woken when the old job crosses the threshold: 1 GPU-s left at 2 GPUs.
    assert d.memory["next_decision_at_s"] == pytest.approx(500.5)
    # At the threshold the old job drops to Q1 and the new one (Q0) preempts it.
    at = msgspec.structs.replace(old, attained_service_gpu_s=1000.0)
    d = policy.decide(view(500.5, 2, at, new), d.memory)
    assert d.shares == {"new": 2}
    assert d.memory["jobs"]["old"][2] == 500.5  # preempted now


def test_backfill_scans_past_a_job_that_does_not_fit() -> None:
    policy = TiresiasL()
    big = job("big", arrival_s=0.0, requested_gpus=8, max_gpus=8)
    small = job("small", arrival_s=5.0, requested_gpus=2, max_gpus=2)
    d = policy.decide(view(10.0, 4, big, small), {})
    assert d.shares == {"small": 2}


def test_restarted_job_reenters_q0_and_whole_count_option() -> None:
    thresholds = (100.0,)
    a = job("a", arrival_s=0.0, requested_gpus=1, attained_service_gpu_s=150.0)
    b = job("b", arrival_s=1.0, requested_gpus=1, attained_service_gpu_s=50.0, current_gpus=1)
    memory = {"jobs": {"a": [0.0, 0.0, 20.0], "b": [0.0, 2.0, -1.0]}}
    # Counted since restart: a is in Q1 until it restarts; b (Q0) keeps the GPU.
    d = TiresiasL(queue_thresholds_gpu_s=thresholds).decide(view(100.0, 1, a, b), memory)
    assert d.shares == {"b": 1}
    # With 2 GPUs a restarts, and its count starts again from its current service.
    d = TiresiasL(queue_thresholds_gpu_s=thresholds).decide(view(100.0, 2, a, b), memory)
    assert d.shares == {"a": 1, "b": 1}
    assert d.memory["jobs"]["a"][0] == 150.0
    # Whole-service counting keeps the base at 0.
    d = TiresiasL(queue_thresholds_gpu_s=thresholds, service_since_restart=False).decide(
        view(100.0, 2, a, b), memory
    )
    assert d.memory["jobs"]["a"][0] == 0.0


def test_promotion_after_waiting_knob_times_its_run_time() -> None:
    policy = TiresiasL(queue_thresholds_gpu_s=(100.0,), promote_knob=2.0, service_since_restart=False)
    starved = job("s", arrival_s=0.0, requested_gpus=1, attained_service_gpu_s=200.0)
    runner = job("r", arrival_s=50.0, requested_gpus=1, attained_service_gpu_s=10.0, current_gpus=1)
    memory = {"jobs": {"s": [0.0, 0.0, 100.0, 1.0, 0.0], "r": [0.0, 50.0, -1.0, 0.0, 1.0]}}
    d = policy.decide(view(499.0, 1, starved, runner), memory)
    assert d.shares == {"r": 1}
    assert d.memory["next_decision_at_s"] == pytest.approx(500.0)  # 100 + 2 × 200 s
    # Promoted to the back of Q0 (the reference appends it there): behind r, which keeps
    # the GPU; its count starts again.
    d = policy.decide(view(500.0, 1, starved, runner), memory)
    assert d.shares == {"r": 1}
    assert d.memory["jobs"]["s"][0] == 200.0 and d.memory["jobs"]["s"][3] == 0.0
    # Ahead of every job of Q1, though: a runner of Q1 (ahead of s there) loses the GPU to it.
    served = msgspec.structs.replace(runner, attained_service_gpu_s=150.0)
    memory = {"jobs": {"s": [0.0, 0.0, 100.0, 1.0, 1.0], "r": [0.0, 50.0, -1.0, 1.0, 0.0]}}
    assert policy.decide(view(499.0, 1, starved, served), memory).shares == {"r": 1}
    assert policy.decide(view(500.0, 1, starved, served), memory).shares == {"s": 1}


# ---------------------------------------------------------------------------
# Hand-made traces through the simulator (the engine of ``shoal simulate``)
# ---------------------------------------------------------------------------

LINEAR2 = ThroughputCurve(model="linear", throughput=(0.0, 1.0, 2.0))


def rigid(job_id: str, arrival_s: float, duration_s: float, gpus: int) -> TraceJob:
    """A non-elastic job of ``gpus`` GPUs running ``duration_s`` seconds at that size."""
    return make_job(job_id, arrival_s, duration_s, gpus, LINEAR2, cap_at_request=True, elastic=False)


class Recording:
    """A policy that records the shares of every decision the simulator asks it for."""

    def __init__(self, policy: TiresiasL) -> None:
        self.policy = policy
        self.name = policy.name
        self.elastic = policy.elastic
        self.plan: list[tuple[float, dict[str, int]]] = []

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        decision = self.policy.decide(view, memory)
        if not self.plan or self.plan[-1][1] != decision.shares:
            self.plan.append((view.now_s, dict(decision.shares)))
        return decision


def simulate(jobs: list[TraceJob], policy: TiresiasL, gpus: int) -> tuple[list[Any], dict[str, float]]:
    """(the changes of shares with their times, completion time per job) on a flat pool."""
    recording = Recording(policy)
    result = Simulator(jobs, recording, SimConfig(total_gpus=gpus, flat=True)).run()
    return recording.plan, {o.job_id: o.completion_s for o in result.jobs}


def test_hand_trace_demoted_job_queues_behind_a_waiting_one_and_a_restart_reenters_q0() -> None:
    """2 GPUs, one threshold of 200 GPU-s; A (2 GPUs, 250 s), B (1 GPU, 300 s) and
    C (1 GPU, 150 s) all arrive at t = 0, in that order. By the reference's rules
    (``dlas-gpu``), with the count since the last restart (AFS):

    * t=0: Q0 = [A, B, C]; A takes both GPUs, B and C wait (backfill finds no room).
    * t=100: A reaches 200 GPU-s and goes to the back of Q1 = [A]. Q0 = [B, C] run;
      A, needing 2, is preempted (100 of its 250 s done).
    * t=250: C ends (150 GPU-s, never left Q0). A still does not fit: 1 GPU idles.
    * t=300: B reaches 200 GPU-s: Q1 = [A (waiting), B (running)]. A comes first, fits,
      restarts: its count starts again and it re-enters Q0. B is preempted (200/300 s).
    * t=400: A has 200 GPU-s since its restart: back of Q1 = [B, A]. B, ahead, restarts
      (into Q0); A does not fit beside it and is preempted (200/250 s).
    * t=500: B ends; A restarts and ends at t=550.

    JCTs A 550, B 500, C 250. Ordering Q1 by first start instead (the earlier rule) runs
    A on at t=400 (started at 0, before B): A 450, B 550.

    Counting all service (``service_since_restart=False``, the reference's own count):
    at t=300 A restarts but stays in Q1, now ahead of the waiting B (waiting jobs go
    behind the running ones after each pass), and Q1 is the last queue, so A runs to the
    end at 450 and B then to 550.
    """
    jobs = [rigid("A", 0, 250, 2), rigid("B", 0, 300, 1), rigid("C", 0, 150, 1)]
    plan, done = simulate(jobs, TiresiasL(queue_thresholds_gpu_s=(200.0,)), gpus=2)
    assert plan == [
        (0.0, {"A": 2}),
        (100.0, {"B": 1, "C": 1}),
        (250.0, {"B": 1}),
        (300.0, {"A": 2}),
        (400.0, {"B": 1}),
        (500.0, {"A": 2}),
        (550.0, {}),
    ]
    assert done == {"A": 550.0, "B": 500.0, "C": 250.0}

    whole = TiresiasL(queue_thresholds_gpu_s=(200.0,), service_since_restart=False)
    plan, done = simulate(jobs, whole, gpus=2)
    assert [t for t, _ in plan] == [0.0, 100.0, 250.0, 300.0, 450.0, 550.0]
    assert done == {"A": 450.0, "B": 550.0, "C": 250.0}


def test_hand_trace_waiting_jobs_fall_behind_the_running_ones_in_their_queue() -> None:
    """2 GPUs, one threshold of 200 GPU-s; X (2 GPUs, 300 s) and Y (1 GPU, 400 s) arrive
    at t = 0, Z (1 GPU, 250 s) at t = 150. By the reference's rules:

    * t=0: Q0 = [X, Y]; X takes both GPUs.
    * t=100: X reaches 200 GPU-s: Q1 = [X]. Y runs; X does not fit beside it
      (preempted, 100/300 s done); 1 GPU idles.
    * t=150: Z arrives: Q0 = [Y, Z], both run.
    * t=300: Y reaches 200 GPU-s: Q1 = [X, Y]. Z keeps its GPU (Q0); X does not fit in the
      one left, Y does and keeps running. After the pass the waiting X goes behind the
      running Y: Q1 = [Y, X].
    * t=350: Z reaches 200 GPU-s: Q1 = [Y, X, Z]. Y keeps its GPU, X does not fit, Z does.
      After the pass: Q1 = [Y, Z, X].
    * t=400: Z ends. Q1 = [Y, X]: Y runs, X does not fit.
    * t=500: Y ends; X restarts (re-entering Q0 when counting since restarts, where it
      crosses 200 GPU-s again at t=600 alone) and ends at t=700.

    JCTs X 700, Y 500, Z 250 with either count. Without the move behind the running jobs
    (or by first start, the earlier rule), X would lead Q1 at t=350 and take both GPUs
    from Y and Z: X 550, Y 700, Z 450.
    """
    jobs = [rigid("X", 0, 300, 2), rigid("Y", 0, 400, 1), rigid("Z", 150, 250, 1)]
    expected_plan = [
        (0.0, {"X": 2}),
        (100.0, {"Y": 1}),
        (150.0, {"Y": 1, "Z": 1}),
        (400.0, {"Y": 1}),
        (500.0, {"X": 2}),
        (700.0, {}),
    ]
    for since_restart in (True, False):
        policy = TiresiasL(queue_thresholds_gpu_s=(200.0,), service_since_restart=since_restart)
        plan, done = simulate(jobs, policy, gpus=2)
        assert plan == expected_plan
        assert done == {"X": 700.0, "Y": 500.0, "Z": 400.0}


class LengthTripwire(JobView, frozen=True, kw_only=True):
    """A job view that fails the test when a length-unaware policy reads its length."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("remaining_iterations", "total_iterations"):
            raise AssertionError(f"a length-unaware policy read {name}")
        return super().__getattribute__(name)


def test_never_reads_remaining_iterations() -> None:
    jobs = [LengthTripwire(job_id=f"j{i}", requested_gpus=1, arrival_s=float(i)) for i in range(3)]
    d = TiresiasL().decide(ClusterView(now_s=5.0, total_gpus=2, jobs=tuple(jobs)), {})
    assert d.shares == {"j0": 1, "j1": 1}


@settings(max_examples=60, deadline=None)
@given(views())
def test_properties(v: ClusterView) -> None:
    d = assert_pure(TiresiasL(queue_thresholds_gpu_s=(300.0, 5000.0), promote_knob=1.0), v)
    for job_id, g in d.shares.items():
        j = next(x for x in v.jobs if x.job_id == job_id)
        assert g == gang_size(j)


def test_runs_a_philly_prefix_to_completion() -> None:
    workload = load_workload("philly:2869ce:150", seed=0)
    summary = Simulator(workload, TiresiasL(), SimConfig(flat=True)).run().summary
    assert summary["completed"] == summary["jobs"] == 150
    # Non-elastic: jobs start and stop, never resize.
    assert summary["reconfigurations"] == 0


@hs.composite
def queued_views(draw: hs.DrawFn) -> tuple[ClusterView, dict[str, Any]]:
    """Views where many jobs never ran (no service, no GPUs), with a memory that records
    some jobs (also finished ones, ones whose service is not counted from 0, ones whose
    kept queue is not the one their service gives, and three-number records)."""
    v = draw(views(max_jobs=16))
    jobs = []
    for j in v.jobs:
        kind = draw(hs.integers(0, 3))
        if kind <= 1:  # never ran
            j = msgspec.structs.replace(j, attained_service_gpu_s=0.0, current_gpus=0)
        elif kind == 2:  # started just now (or by another policy): GPUs, no service yet
            j = msgspec.structs.replace(j, attained_service_gpu_s=0.0)
        jobs.append(j)
    records: dict[str, Any] = {}
    for j in [*jobs, job("gone")]:
        if draw(hs.integers(0, 2)) == 0:
            records[j.job_id] = [
                draw(hs.sampled_from([0.0, 100.0, 250_000.0])),
                draw(hs.sampled_from([-1.0, 0.0, v.now_s])),
                draw(hs.sampled_from([-1.0, 0.0])),
            ]
            if draw(hs.integers(0, 3)):  # a queue and a place in it (else a three-number record)
                records[j.job_id] += [float(draw(hs.integers(0, 2))), float(draw(hs.integers(0, 6)))]
    arrival_ordered = draw(hs.booleans())
    if arrival_ordered:
        jobs.sort(key=lambda j: (j.arrival_s, j.job_id))
    return ClusterView(
        now_s=v.now_s, total_gpus=v.total_gpus, jobs=tuple(jobs), arrival_ordered=arrival_ordered
    ), {"jobs": records}


@settings(max_examples=200, deadline=None)
@given(queued_views(), hs.sampled_from([(300.0,), (300.0, 5000.0), (180_000.0,)]), hs.booleans())
def test_lazy_queue_walk_decides_as_sorting_every_job(
    case: tuple[ClusterView, dict[str, Any]], thresholds: tuple[float, ...], since_restart: bool
) -> None:
    """decide (the never-started jobs walked lazily) equals decide_all (every job's
    record sorted), decision and memory, over a few rounds."""
    v, memory = case
    policy = TiresiasL(queue_thresholds_gpu_s=thresholds, service_since_restart=since_restart)
    for _ in range(3):
        fast = policy.decide(v, memory)
        assert fast == policy.decide_all(v, memory)
        memory = fast.memory
        v = next_view(v, fast, 400.0)


def kept_next_view(v: ClusterView, decision: Decision, dt: float, step: int) -> ClusterView:
    """:func:`next_view`, keeping the view object of every job that neither holds nor is
    given GPUs (as the simulator does for a job nothing changed); ``step`` 3 ends the
    first job given GPUs, ``step`` 4 adds an arrival that never ran."""
    jobs = []
    moved = next_view(v, decision, dt).jobs
    for old, new in zip(v.jobs, moved, strict=True):
        jobs.append(old if not old.current_gpus and not decision.shares.get(old.job_id) else new)
    if step == 3:
        jobs = [j for j in jobs if j.job_id != next(iter(decision.shares), None)]
    if step == 4:
        jobs.append(job(f"new{v.now_s}", arrival_s=v.now_s + dt, requested_gpus=2, max_gpus=2))
    return ClusterView(now_s=v.now_s + dt, total_gpus=v.total_gpus, jobs=tuple(jobs))


@settings(max_examples=150, deadline=None)
@given(
    queued_views(),
    hs.sampled_from([(300.0,), (300.0, 5000.0), (180_000.0,)]),
    hs.booleans(),
    hs.lists(hs.integers(0, 4), min_size=3, max_size=6),
)
def test_tiresias_l_carried_records_change_no_decision(
    case: tuple[ClusterView, dict[str, Any]],
    thresholds: tuple[float, ...],
    since_restart: bool,
    steps: list[int],
) -> None:
    """A policy that carries its records over between decisions decides as one that reads
    every record from memory: shares, and memory with its entries in the same order.
    Each round hands it its own memory, an equal copy (decoded from msgpack), or a
    changed one (a record's base moved: the carried records must not be taken), over
    views that keep unchanged jobs' objects, with completions and arrivals."""
    v, memory = case
    kw: dict[str, Any] = {"queue_thresholds_gpu_s": thresholds, "service_since_restart": since_restart}
    carried = TiresiasL(**kw)
    for step in steps:
        fresh = TiresiasL(**kw).decide(v, memory)
        d = carried.decide(v, memory)
        assert d == fresh
        assert list(d.memory["jobs"].items()) == list(fresh.memory["jobs"].items())
        memory = d.memory
        if step == 1:
            memory = msgspec.msgpack.decode(msgspec.msgpack.encode(memory))
        elif step == 2 and memory["jobs"]:
            first = next(iter(memory["jobs"]))
            entry = list(memory["jobs"][first])
            entry[0] += 50.0
            memory = {**memory, "jobs": {**memory["jobs"], first: entry}}
        v = kept_next_view(v, d, 400.0, step)


def test_the_simulators_decisions_are_those_of_a_record_for_every_job() -> None:
    """6214e9's first jobs queue up behind long runners (hundreds wait) on the 16 x 4
    topology; 2869ce on a flat pool."""

    def against_every_record(v: ClusterView, memory: Mapping[str, Any], d: Decision) -> None:
        ref = TiresiasL().decide_all(v, memory)
        assert d == ref
        assert list(d.memory["jobs"].items()) == list(ref.memory["jobs"].items())

    for trace, flat in (("philly:6214e9:300", False), ("philly:2869ce:150", True)):
        policy = run_checked(TiresiasL(), against_every_record, trace, flat)
        assert policy.decisions > 100 and policy.started > 50


def test_a_rebuilt_job_with_service_and_no_record_is_looked_at() -> None:
    """With the simulator's jobs and carried records, only the views rebuilt since the
    last decision are looked at for service or GPUs without a record. A job that never ran
    here but shows service past the threshold (it ran elsewhere) is demoted as decide_all
    demotes it."""
    from shoal.policies.base import LiveJobs

    a = job("a", arrival_s=0.0, requested_gpus=1, max_gpus=1)
    b = job("b", arrival_s=1.0, requested_gpus=1, max_gpus=1)
    policy = TiresiasL()
    first = ClusterView(
        now_s=0.0, total_gpus=1, jobs=LiveJobs({"a": a, "b": b}, serial=1), arrival_ordered=True
    )
    d = policy.decide(first, {})
    assert d.shares == {"a": 1}
    a2 = msgspec.structs.replace(a, current_gpus=1, attained_service_gpu_s=100.0)
    b2 = msgspec.structs.replace(b, attained_service_gpu_s=200_000.0)
    second = ClusterView(
        now_s=100.0,
        total_gpus=1,
        jobs=LiveJobs({"a": a2, "b": b2}, serial=2, after=1, rebuilt=("a", "b"), left=()),
        arrival_ordered=True,
    )
    lazy = policy.decide(second, d.memory)
    ref = TiresiasL().decide_all(second, d.memory)
    assert lazy == ref and list(lazy.memory["jobs"].items()) == list(ref.memory["jobs"].items())
    assert "b" in lazy.memory["jobs"]  # demoted to Q1: a place at its back

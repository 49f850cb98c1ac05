"""The simulator's engine: determinism, capacity, the fold, reconfiguration costs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
from shoal import events as ev
from shoal.models import ThroughputCurve
from shoal.policies.base import ClusterView, Decision, jobs_by_id, policy_reads_progress
from shoal.policies.common import arrival_order
from shoal.policies.registry import policy_names
from shoal.profiling.overestimate import first_share_view
from shoal.sim.costs import ReconfigCosts, classify, get_costs
from shoal.sim.engine import SimConfig, SimResult, SimulationStalled, Simulator, make_policy
from shoal.state import digest, fold
from shoal.view import build_view, estimated_jobs
from shoal.workloads import load_workload, make_job

from tests.sim.helpers import events_of
from tests.sim.toy_policies import ToyEqual, ToyFifo, ToyTyped

LINEAR = ThroughputCurve(model="linear", throughput=(0.0, 1.0, 2.0, 3.0, 4.0))


def run(jobs, policy, cfg: SimConfig) -> tuple[Simulator, SimResult]:
    sim = Simulator(jobs, policy, cfg)
    return sim, sim.run()


@pytest.fixture(scope="module")
def philly_small():
    return load_workload("philly:2869ce:80", seed=0)


@pytest.mark.parametrize("flat", [True, False])
def test_same_seed_same_run(philly_small, flat: bool) -> None:
    cfg = SimConfig(flat=flat, tick_s=3600.0)
    a = Simulator(philly_small, ToyEqual(), cfg).run()
    b = Simulator(load_workload("philly:2869ce:80", seed=0), ToyEqual(), cfg).run()
    assert a.final_digest == b.final_digest
    assert msgspec.json.encode(a) == msgspec.json.encode(b)
    # A different model draw is a different run.
    c = Simulator(load_workload("philly:2869ce:80", seed=1), ToyEqual(), cfg).run()
    assert c.final_digest != a.final_digest


@pytest.mark.parametrize("flat", [True, False])
def test_final_state_is_the_fold_of_the_log(philly_small, flat: bool) -> None:
    sim, result = run(philly_small, ToyEqual(), SimConfig(flat=flat, costs=get_costs("restart")))
    replayed = fold(sim.log.envelopes)
    assert digest(replayed) == result.final_digest == digest(sim.log.state)
    # Every job completed in the replayed state, at the simulator's completion time.
    done = {o.job_id: o.completion_s for o in result.jobs}
    assert {j: s.finished_at for j, s in replayed.jobs.items()} == done


@pytest.mark.parametrize("flat", [True, False])
def test_capacity_is_never_exceeded(philly_small, flat: bool) -> None:
    sim, result = run(philly_small, ToyEqual(tick_s=1800.0), SimConfig(flat=flat, total_gpus=32))
    decisions = 0
    for env in sim.log.envelopes:
        e = env.event
        if isinstance(e, ev.SharesDecided):
            assert sum(e.shares.values()) <= 32
            decisions += 1
        elif isinstance(e, ev.PlacementDecided):
            gpus = [g for placed in e.placements.values() for g in placed]
            assert len(gpus) == len(set(gpus)) <= 32
    assert decisions > 10
    assert max(result.series.gpus_used) <= 32
    assert result.summary["gpu_utilisation"] <= 1.0


def test_run_time_at_request_equals_trace_duration() -> None:
    # Each job alone on the cluster with its requested GPUs (FIFO, far-apart arrivals).
    jobs = [
        make_job(f"j{i}", 10_000.0 * i, d, req, c)
        for i, (d, req, c) in enumerate(
            [
                (3601, 1, LINEAR),
                (77, 2, LINEAR),
                (
                    5000,
                    4,
                    ThroughputCurve(model="sub", throughput=(0.0, 1.0, 1.7, 2.2, 2.5)),
                ),
            ]
        )
    ]
    for flat in (True, False):
        result = Simulator(jobs, ToyFifo(), SimConfig(total_gpus=4, flat=flat)).run()
        for job, outcome in zip(jobs, result.jobs, strict=True):
            assert outcome.jct_s == job.duration_s
            assert outcome.wait_s == 0.0


def test_real_trace_jobs_calibrated_to_their_duration() -> None:
    jobs = load_workload("philly:b436b2:40", seed=2)
    for job in jobs:
        total = job.spec.total_iterations
        assert total is not None
        run_time = total / job.throughput[job.spec.requested_gpus]
        assert run_time == pytest.approx(job.duration_s, rel=1e-12)
    # And in the simulator: a job alone finishes after exactly its duration.
    solo = [j for j in jobs if j.spec.requested_gpus <= 8][:3]
    spaced = [msgspec.structs.replace(j, submit_time_s=1e7 * i) for i, j in enumerate(solo)]
    result = Simulator(spaced, ToyFifo(), SimConfig(total_gpus=8, flat=True)).run()
    assert [o.jct_s for o in result.jobs] == [j.duration_s for j in spaced]


def two_jobs(b_duration: float) -> list:
    # A: 400 iterations at 4 iterations/s on 4 GPUs; B: b_duration iterations at 1/s on 1 GPU.
    return [
        make_job("a", 0, 100.0, 4, LINEAR),
        make_job("b", 20, b_duration, 1, LINEAR),
    ]


def test_reconfiguration_stop_times() -> None:
    costs = ReconfigCosts(scale_in_s=10.0, scale_out_s=5.0)
    sim, result = run(two_jobs(100.0), ToyEqual(), SimConfig(total_gpus=4, flat=True, costs=costs))
    done = {o.job_id: o.completion_s for o in result.jobs}
    # t=20: B arrives, A 4 -> 2 (scale-in, stopped until 30), B starts (free) at 2 GPUs.
    # B: 100 iterations at 2/s -> done at 70. A: 80 done at 20, +2/s from 30 to 70 -> 160.
    # t=70: A 2 -> 4 (scale-out, stopped until 75), 240 left at 4/s -> done at 135.
    assert done == {"a": 135.0, "b": 70.0}
    assert result.summary["lost_gpu_s"] == pytest.approx(10 * 2 + 5 * 4)
    completed = [
        (at, e.stop_time_s) for at, e in events_of(sim.log, ev.ReconfigurationCompleted) if e.job_id == "a"
    ]
    assert completed == [(0.0, 0.0), (30.0, 10.0), (75.0, 5.0)]
    assert result.summary["reconfigurations"] == 2
    assert not any(isinstance(e.event, ev.ReconfigurationCancelled) for e in sim.log.envelopes)


def test_newer_change_cancels_the_in_flight_one() -> None:
    costs = ReconfigCosts(scale_in_s=10.0, scale_out_s=5.0)
    # B needs 10 iterations: at 2 GPUs it is done at t=25, while A's scale-in (until 30)
    # is still in flight; A's scale-out at 25 cancels it and stops A until 30.
    sim, result = run(two_jobs(10.0), ToyEqual(), SimConfig(total_gpus=4, flat=True, costs=costs))
    done = {o.job_id: o.completion_s for o in result.jobs}
    # A: 80 done at 20, no progress while stopped (20-30), 320 left at 4/s -> 110.
    assert done == {"a": 110.0, "b": 25.0}
    cancelled = events_of(sim.log, ev.ReconfigurationCancelled)
    assert len(cancelled) == 1 and cancelled[0][0] == 25.0
    c = cancelled[0][1]
    assert c.job_id == "a" and c.by_epoch > c.epoch
    completed = [
        (at, e.epoch) for at, e in events_of(sim.log, ev.ReconfigurationCompleted) if e.job_id == "a"
    ]
    # The cancelled epoch never completes; the newer one completes at 25 + 5.
    assert completed[1:] == [(30.0, c.by_epoch)]
    assert c.epoch not in {epoch for _, epoch in completed}
    # Lost GPU time: 5 s of the cancelled scale-in on 2 GPUs, 5 s of the scale-out on 4.
    assert result.summary["lost_gpu_s"] == pytest.approx(5 * 2 + 5 * 4)
    assert sim.log.state.jobs["a"].stop_time_s == pytest.approx(5.0)


def test_cost_model_presets_and_parsing() -> None:
    assert classify(0, 4, False) == "start"
    assert classify(4, 0, False) == "stop"
    assert classify(2, 4, False) == "scale_out"
    assert classify(4, 2, True) == "scale_in"
    assert classify(4, 4, True) == "migrate"
    assert classify(4, 4, False) is None
    assert get_costs("free").stop_time("scale_in") == 0.0
    assert get_costs("restart").stop_time("migrate") == 30.0
    custom = get_costs("scale_out=0.5,migrate=20")
    assert (custom.scale_out_s, custom.migrate_s, custom.scale_in_s) == (0.5, 20.0, 0.0)
    with pytest.raises(ValueError, match="cost model"):
        get_costs("bogus")


def test_afs_metrics_on_a_hand_checked_workload() -> None:
    # 2 GPUs, FIFO. A (t=0) takes both GPUs, sublinear: 1 -> 1.5 iterations/s, so
    # CE = (1.5 / 1) / 2 = 0.75. B (t=10, 1 GPU, 50 s) and C (t=30, 1 GPU, 20 s) wait.
    sub = ThroughputCurve(model="sub", throughput=(0.0, 1.0, 1.5))
    jobs = [
        make_job("a", 0, 100, 2, sub),
        make_job("b", 10, 50, 1, LINEAR),
        make_job("c", 30, 20, 1, LINEAR),
    ]
    result = Simulator(jobs, ToyFifo(), SimConfig(total_gpus=2, flat=True)).run()
    s = result.series
    assert s.t[:4] == [0.0, 10.0, 30.0, 100.0]
    assert s.ql[:4] == [0, 1, 2, 0]
    assert s.ce[:4] == [0.75, 0.75, 0.75, 1.0]
    # BI at 30: B pended 20 s of 50 s remaining; C 0 s of 20 s -> (0.4 + 0) / 2.
    assert s.bi[:4] == pytest.approx([0.0, 0.0, 0.2, 0.0], abs=1e-12)
    # Between decisions pending times grow: slope (1/50 + 1/20) / 2 from t=30.
    assert s.bi_slope[2] == pytest.approx((1 / 50 + 1 / 20) / 2)
    assert s.value_at("bi", 2, 100.0) == pytest.approx((90 / 50 + 70 / 20) / 2)
    # Time averages over [0, 120] (C finishes at 120, B at 150; makespan 150).
    end = result.summary["makespan_s"]
    assert end == 150.0
    assert result.jobs[1].completion_s == 150.0 and result.jobs[2].completion_s == 120.0
    ql_avg = (1 * 20 + 2 * 70) / end
    assert result.summary["avg_ql"] == pytest.approx(ql_avg)
    # 10-30: B alone pending, BI = (t-10)/50, integral 20^2/100 = 4.
    bi_avg = (20**2 / 2 / 50 + 70 * 0.2 + s.bi_slope[2] * 70**2 / 2) / end
    assert result.summary["avg_bi"] == pytest.approx(bi_avg)
    ce_avg = (0.75 * 100 + 1.0 * 20 + 0.5 * 30) / end
    assert result.summary["avg_ce"] == pytest.approx(ce_avg)


def test_stall_is_reported_not_looped() -> None:
    # A job that can never fit under FIFO's "requested or nothing".
    job = make_job("big", 0, 10, 4, LINEAR)
    with pytest.raises(SimulationStalled):
        Simulator([job], ToyFifo(), SimConfig(total_gpus=2, flat=True)).run()


def test_max_time_stops_early(philly_small) -> None:
    result = Simulator(philly_small, ToyEqual(), SimConfig(max_time_s=1_000_000.0)).run()
    assert 0 < result.summary["completed"] < len(philly_small)
    assert all(o.completion_s is None or o.completion_s <= 1_000_000.0 for o in result.jobs)
    assert not math.isnan(result.summary["avg_jct_s"])


def _without_running_progress(view: ClusterView) -> ClusterView:
    jobs = tuple(
        msgspec.structs.replace(j, iterations_done=0.0, remaining_iterations=None, attained_service_gpu_s=0.0)
        if j.current_gpus
        else j
        for j in view.jobs
    )
    return msgspec.structs.replace(view, jobs=jobs)


class _CheckView:
    """Wraps a policy; at every decision compares the engine's view with build_view's."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.name = policy.name
        self.sim: Simulator | None = None
        self.checked = 0
        self.waiting = 0
        self.before: tuple[int, dict[str, Any]] | None = None
        self.kept = 0
        self.left = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.policy, attr)

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        sim = self.sim
        assert sim is not None
        now = view.now_s
        expected = build_view(
            sim.log.state,
            now=now,
            gpus_per_node=0 if sim.config.flat else sim.config.gpus_per_node,
            total_gpus=sim.total_gpus,
            curves=sim.curves,
            curves_by_type=sim.curves_by_type if sim.hetero else None,
            progress={j: job.progress(now) for j, job in sim.active.items()},
            job_ids=sim.active.keys(),
        )
        if sim.config.profiling == "overestimate":
            # The policy decides on the view with new jobs capped at 1/n (CoDDL §4.5).
            expected = first_share_view(expected, estimated_jobs(sim.log.state, sim.active))
        got = msgspec.structs.replace(view, arrival_ordered=False)
        if not policy_reads_progress(self.policy):
            # Such a policy sees running jobs' progress as of the newest event about them.
            got, expected = _without_running_progress(got), _without_running_progress(expected)
        assert got == expected
        # The engine's promises: the jobs are in arrival order when it says so, and the
        # index it primes is the view's.
        if view.arrival_ordered:
            assert list(view.jobs) == arrival_order(view.jobs)
        assert jobs_by_id(view) == {j.job_id: j for j in view.jobs}
        # Every view not named rebuilt since the previous decision's is the very object
        # it was then (LiveJobs.rebuilt_since), and the engine names them every time.
        serial = getattr(view.jobs, "serial", 0)
        table = {j.job_id: j for j in view.jobs}
        if self.before is not None and serial:
            before_serial, before = self.before
            rebuilt = view.jobs.rebuilt_since(before_serial)  # type: ignore[attr-defined]
            assert rebuilt is not None
            for job_id, job in table.items():
                if job_id not in rebuilt:
                    assert before.get(job_id) is job
                    self.kept += 1
            # The jobs of the previous decision that are gone are named as having left
            # (LiveJobs.left_since), and none that is still here.
            left = view.jobs.left_since(before_serial)  # type: ignore[attr-defined]
            assert left is not None
            assert before.keys() - table.keys() <= set(left)
            assert not table.keys() & set(left)
            self.left += len(left)
        self.before = (serial, table) if serial else None
        self.checked += 1
        self.waiting += sum(1 for j in view.jobs if not j.current_gpus)
        return self.policy.decide(view, memory)


@pytest.mark.parametrize(
    ("trace", "cfg", "policy"),
    [
        ("philly:2869ce:120", SimConfig(total_gpus=16), "toy"),
        ("philly:2869ce:120", SimConfig(total_gpus=16, flat=True, profiling="overestimate"), "toy"),
        (
            "poisson:n=40,rate=60,users=2,catalog=gavel,mean_duration_s=1800",
            SimConfig(cluster={"k80": 8, "v100": 8}, users={"user-0": 100, "user-1": 50}),
            "toy",
        ),
        # Contended processor sharing: most decisions move running jobs only in time.
        ("philly:2869ce:50", SimConfig(total_gpus=8), "afs-p"),
        # The same, with running jobs' views carried to every decision (AFS-P reads no
        # progress, so by default they are not).
        ("philly:2869ce:50", SimConfig(total_gpus=8), "afs-p-carried"),
    ],
)
def test_engine_view_equals_build_view(trace: str, cfg: SimConfig, policy: str) -> None:
    if policy.startswith("afs-p"):
        from shoal.policies.afs import AFSP

        policy_obj: Any = AFSP(unit_s=900.0)
        if policy == "afs-p-carried":
            policy_obj.reads_progress = True
    else:
        policy_obj = ToyTyped() if cfg.cluster else ToyEqual(tick_s=600.0)
    checked = _CheckView(policy_obj)
    sim = Simulator(load_workload(trace, seed=0), checked, cfg)
    checked.sim = sim
    sim.run()
    assert checked.checked > 20
    assert checked.waiting > 0  # the memoised (waiting) views were exercised
    if cfg.profiling != "overestimate":  # (then the policy decides on a copy, a tuple)
        assert checked.kept > 0  # and named as not rebuilt
        assert checked.left > 0  # and the finished jobs named as having left


class _CheckedMetrics(Simulator):
    """Compares the running sums with a from-scratch recomputation at every sample."""

    samples = 0

    def _sample(self, now: float) -> None:
        super()._sample(now)
        ql, ce, bi, slope, held = self.recompute_metrics(now)
        s = self.series
        assert s.ql[-1] == ql
        assert s.ce[-1] == pytest.approx(ce, rel=1e-9, abs=1e-12)
        assert s.bi[-1] == pytest.approx(bi, rel=1e-6, abs=1e-9)
        assert s.bi_slope[-1] == pytest.approx(slope, rel=1e-9, abs=1e-15)
        assert self._held == held
        self.samples += 1


@pytest.mark.parametrize(
    ("trace", "cfg"),
    [
        ("philly:2869ce:150", SimConfig(total_gpus=16, costs=get_costs("restart"))),
        ("philly:b436b2:80", SimConfig(total_gpus=16, flat=True)),
        (
            "poisson:n=40,rate=60,users=3,catalog=gavel,mean_duration_s=1800",
            SimConfig(cluster={"k80": 8, "v100": 8}),
        ),
    ],
)
def test_running_metric_sums_match_a_recomputation(trace: str, cfg: SimConfig) -> None:
    policy = ToyTyped() if cfg.cluster else ToyEqual(tick_s=900.0)
    sim = _CheckedMetrics(load_workload(trace, seed=0), policy, cfg)
    sim.run()
    assert sim.samples > 20
    assert max(sim.series.ql) > 0  # queues formed, so BI was exercised


def test_jobs_arriving_in_one_second_out_of_id_order_are_still_ranked_by_id() -> None:
    # Arrival order is (arrival time, job id). The trace lists "b" before "a" in the same
    # second, so the engine's view is not in that order and must not say it is: AFS-P
    # then sorts, and the run decides exactly as with the trace listed in order.
    from shoal.policies.afs import AFSP

    def trace(order: list[str]) -> list:  # type: ignore[type-arg]
        return [make_job(j, 0, 600.0, 1, LINEAR, elastic=False) for j in order] + [
            make_job("c", 5, 600.0, 1, LINEAR, elastic=False)
        ]

    def shares_decided(jobs: list) -> tuple[bool, list[tuple[float, dict[str, int]]]]:  # type: ignore[type-arg]
        checked = _CheckView(AFSP(unit_s=100.0))
        sim = Simulator(jobs, checked, SimConfig(total_gpus=1, flat=True))
        checked.sim = sim
        sim.run()
        return sim._arrival_ordered, [(at, e.shares) for at, e in events_of(sim.log, ev.SharesDecided)]

    unordered, decided = shares_decided(trace(["b", "a"]))
    ordered, expected = shares_decided(trace(["a", "b"]))
    assert (unordered, ordered) == (False, True)
    assert decided == expected
    assert decided[0] == (0.0, {"a": 1})  # the tie goes to the smaller id
    assert len(decided) > 3  # leases rotated the GPU between the jobs


def test_the_placement_shortcut_changes_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # A congested topology run (AFS-P on 2 × 8 GPUs): most placements take min-migration's
    # shortcut for kept and new jobs. With the shortcut turned off the full steps place
    # every decision, and the log must be the same, event for event.
    import shoal.placement.min_migration as mm

    real = mm._place_kept_and_new
    taken = 0

    def counted(*args: Any) -> Any:
        nonlocal taken
        out = real(*args)
        taken += out is not None
        return out

    def log_of() -> list[Any]:
        from shoal.policies.afs import AFSP

        cfg = SimConfig(total_gpus=16, gpus_per_node=8)
        sim = Simulator(load_workload("philly:2869ce:120", seed=0), AFSP(unit_s=3600.0), cfg)
        sim.run()
        return [(env.at, env.event) for env in sim.log.envelopes]

    monkeypatch.setattr(mm, "_place_kept_and_new", counted)
    with_shortcut = log_of()
    assert taken > 1000  # the shortcut was actually exercised (about 3,300 of 3,400 placements)
    monkeypatch.setattr(mm, "_place_kept_and_new", lambda *args: None)
    assert log_of() == with_shortcut


_NO_PROGRESS = [n for n in policy_names() if not policy_reads_progress(make_policy(n))]


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("name", _NO_PROGRESS)
def test_a_policy_that_reads_no_progress_decides_the_same_given_it(name: str, flat: bool) -> None:
    """A policy that declares ``reads_progress = False`` sees running jobs' views as of
    the newest event about them; it must decide exactly as when they are carried to
    every decision (the whole result: summary, digest, per-job outcomes, series).

    32 GPUs: the slice's largest request, so a rigid policy (FIFO) can start every job
    (on 16 it stalls either way, with 17 jobs of 32 GPUs left waiting)."""
    assert {"afs-p", "max-min", "fifo", "sidecar-default-k8s"} <= set(_NO_PROGRESS)
    cfg = SimConfig(total_gpus=32, flat=flat)
    jobs = load_workload("philly:2869ce:150", seed=0)
    carried: Any = make_policy(name)
    carried.reads_progress = True  # the instance only
    a = Simulator(jobs, make_policy(name), cfg).run()
    b = Simulator(jobs, carried, cfg).run()
    assert a.summary["decisions"] > 100
    assert msgspec.json.encode(a) == msgspec.json.encode(b)


def test_a_policy_that_reads_progress_but_says_not_decides_otherwise() -> None:
    """The check above can fail: SRTF ranks by remaining work, and told that it reads no
    progress it decides on stale remaining work (a different average JCT here)."""
    cfg = SimConfig(total_gpus=64, flat=True)
    jobs = load_workload("philly:2869ce:150", seed=0)
    stale: Any = make_policy("srtf")
    stale.reads_progress = False
    a = msgspec.json.encode(Simulator(jobs, make_policy("srtf"), cfg).run())
    try:
        b = msgspec.json.encode(Simulator(jobs, stale, cfg).run())
    except SimulationStalled:
        b = b""
    assert a != b


class _Keeper:
    """Keeps every view it is given, and a copy of its jobs."""

    name = "keeper"

    def __init__(self) -> None:
        self.inner = ToyFifo()
        self.views: list[tuple[ClusterView, tuple[Any, ...]]] = []

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        self.views.append((view, tuple(view.jobs)))
        return self.inner.decide(view, memory)


def test_a_simulator_view_is_read_for_its_decision_only() -> None:
    """The engine's view reads its own table of job views (no copy of the queue at each
    decision): kept past the decision, it refuses to be read instead of showing later
    jobs; a copy made during the decision stays as it was."""
    policy = _Keeper()
    jobs = load_workload("philly:2869ce:30", seed=0)
    Simulator(jobs, policy, SimConfig(total_gpus=8, flat=True)).run()
    assert len(policy.views) > 3
    for view, copy in policy.views[:-1]:
        with pytest.raises(RuntimeError, match=r"copy view\.jobs"):
            list(view.jobs)
        with pytest.raises(RuntimeError):
            len(view.jobs)
        with pytest.raises(RuntimeError):
            view.jobs[0]
        assert copy and all(isinstance(j, type(copy[0])) for j in copy)
    # The copies are the decisions' views: arrivals and completions changed them.
    assert len({tuple(j.job_id for j in c) for _, c in policy.views}) > 1


def test_live_jobs_is_a_read_only_sequence_equal_to_its_tuple() -> None:
    from shoal.policies.base import JobView, LiveJobs

    table = {j: JobView(job_id=j, arrival_s=float(i)) for i, j in enumerate("abc")}
    live = LiveJobs(table)
    as_tuple = tuple(table.values())
    assert len(live) == 3
    assert list(live) == list(as_tuple)
    assert live[1] is table["b"] and live[-1] is table["c"] and live[:2] == as_tuple[:2]
    assert [j.job_id for j in reversed(live)] == ["c", "b", "a"]
    assert live == as_tuple and as_tuple == live and live != as_tuple[:2]
    assert table["a"] in live
    assert ClusterView(now_s=0.0, total_gpus=1, jobs=live) == ClusterView(
        now_s=0.0, total_gpus=1, jobs=as_tuple
    )
    live.expire()
    with pytest.raises(RuntimeError):
        iter(live)

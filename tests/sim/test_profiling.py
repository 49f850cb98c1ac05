"""Overestimate-first-and-re-adjust-later measurement (CoDDL §4.5) in the simulator."""

from __future__ import annotations

import pytest
from shoal import events as ev
from shoal.models import ThroughputCurve
from shoal.profiling.ratelimit import MIN_INTERVAL_S
from shoal.settings import Settings
from shoal.sim.costs import ReconfigCosts
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.workloads import load_workload, make_job

from tests.sim.helpers import events_of
from tests.sim.toy_policies import ToyEqual, ToyGreedy

PLATEAU = ThroughputCurve(model="plateau", throughput=(0.0, 1.0, 1.9, 1.95, 1.96))


def test_oracle_publishes_the_true_curve_at_arrival() -> None:
    job = make_job("j", 0, 1000, 1, PLATEAU)
    policy = ToyGreedy()
    sim = Simulator([job], policy, SimConfig(total_gpus=4, flat=True))
    result = sim.run()
    assert policy.seen[0][1]["j"] == job.throughput
    # Greedy stops at 2 GPUs (1.95 / 1.9 < 1.05): 1000 iterations at 1.9/s.
    assert result.jobs[0].completion_s == pytest.approx(1000 / 1.9, abs=1)
    assert result.summary["model_updates"] == 0


def test_overestimate_then_readjust() -> None:
    job = make_job("j", 0, 1000, 1, PLATEAU)
    policy = ToyGreedy()
    costs = ReconfigCosts(scale_in_s=2.0)
    cfg = SimConfig(total_gpus=4, flat=True, profiling="overestimate", measure_s=30.0, costs=costs)
    sim = Simulator([job], policy, cfg)
    result = sim.run()
    # At arrival nothing is known: the view assumes linear scaling, so all 4 GPUs go
    # (alone in the cluster, its fair share 1/n is the whole cluster).
    t0, curves0 = policy.seen[0]
    assert t0 == 0.0 and curves0["j"] == (0.0, 1.0, 2.0, 3.0, 4.0)
    true = job.throughput
    models = [(at, e) for at, e in events_of(sim.log, ev.ThroughputModelUpdated)]
    # One measurement per GPU count, each after 30 s there (from the end of the stop):
    # the share 4, then the smaller allocatable units 2 and 1 (CoDDL §4.5).
    assert [(at, e.measured) for at, e in models] == [(30.0, (4,)), (62.0, (2, 4)), (94.0, (1, 2, 4))]
    assert all(e.model_kind == "afs-overestimate" for _, e in models)
    last = models[-1][1]
    for k in (1, 2, 4):
        assert last.throughput[k] == pytest.approx(true[k])
    # 3 is estimated, capped by the measured 4 (never above a measured larger count).
    assert last.throughput[3] == pytest.approx(true[4])
    assert last.overestimated is True  # 3 itself is never measured (not an allocatable unit)
    # Each measurement makes a decision: the next unit, then the re-adjustment to 2 GPUs.
    shares = events_of(sim.log, ev.SharesDecided)
    assert [(t, e.shares, e.trigger) for t, e in shares] == [
        (0.0, {"j": 4}, "arrival"),
        (30.0, {"j": 2}, "model_update"),
        (62.0, {"j": 1}, "model_update"),
        (94.0, {"j": 2}, "model_update"),
    ]
    assert result.summary["reconfigurations"] == 3
    # Two scale-ins of 2 s (to 2 and to 1 GPUs); the scale-out costs nothing here.
    assert result.summary["lost_gpu_s"] == pytest.approx(2.0 * 2 + 2.0 * 1)
    # 30 s at T(4), 2 s stopped, 30 s at T(2), 2 s stopped, 30 s at T(1), the rest at T(2).
    assert job.spec.total_iterations is not None
    done = 30 * (true[4] + true[2] + true[1])
    expected = 94 + (job.spec.total_iterations - done) / true[2]
    assert result.jobs[0].completion_s == pytest.approx(expected, abs=1)


def test_measurement_window_is_the_profilers() -> None:
    assert SimConfig().measure_s == MIN_INTERVAL_S == Settings().profiler_min_interval_s


def test_a_new_job_gets_at_most_its_fair_share_in_the_simulator() -> None:
    # Seven jobs measured sublinear by the time an eighth arrives on 64 GPUs: AFS-P on
    # linear scaling would give the newcomer 16 (its max); §4.5 caps it at 64/8 = 8.
    sub = ThroughputCurve(
        model="sub", throughput=(0.0, *(float(k) if k <= 4 else 4.0 + 0.3 * (k - 4) for k in range(1, 17)))
    )
    jobs = [make_job(f"a{i}", 0, 10**6, 16, sub) for i in range(7)]
    jobs.append(make_job("new", 3000, 10**5, 16, sub))
    cfg = SimConfig(total_gpus=64, gpus_per_node=4, profiling="overestimate", costs=ReconfigCosts())
    sim = Simulator(jobs, make_policy("afs-p"), cfg)
    sim.run()
    first = next(e.shares["new"] for _, e in events_of(sim.log, ev.SharesDecided) if "new" in e.shares)
    assert first == 8
    # The newcomer is then taken through its smaller units (8 measured, then 4, 2, 1).
    mine = [e.measured for _, e in events_of(sim.log, ev.ThroughputModelUpdated) if e.job_id == "new"]
    assert mine[:4] == [(8,), (4, 8), (2, 4, 8), (1, 2, 4, 8)]


def test_a_job_is_measured_again_only_on_a_new_share() -> None:
    jobs = load_workload("philly:2869ce:25", seed=0)
    cfg = SimConfig(profiling="overestimate")
    sim = Simulator(jobs, ToyEqual(), cfg)
    result = sim.run()
    updates = [e for _, e in events_of(sim.log, ev.ThroughputModelUpdated)]
    assert result.summary["model_updates"] == len(updates) > 0
    true = {j.job_id: j.throughput for j in jobs}
    seen: dict[str, tuple[int, ...]] = {}
    for update in updates:
        # Each update adds exactly one measured count (a count is measured once).
        before = seen.get(update.job_id, ())
        assert set(before) < set(update.measured) and len(update.measured) == len(before) + 1
        seen[update.job_id] = update.measured
        # Measured counts carry the true throughput (the estimate's rule for the others
        # is tested in tests/profiling/test_overestimate.py).
        for k in update.measured:
            assert update.throughput[k] == pytest.approx(true[update.job_id][k])
    # Probing the smaller units changes shares, so the log differs from the oracle's.
    oracle = Simulator(jobs, ToyEqual(), SimConfig()).run()
    assert oracle.final_digest != result.final_digest


def test_unknown_profiling_mode() -> None:
    with pytest.raises(ValueError, match="profiling"):
        Simulator([], ToyEqual(), SimConfig(profiling="psychic"))

"""Overestimate-first-and-re-adjust-later measurement (CoDDL §4.5) in the simulator."""

from __future__ import annotations

import pytest
from shoal import events as ev
from shoal.models import ThroughputCurve
from shoal.sim.costs import ReconfigCosts
from shoal.sim.engine import SimConfig, Simulator
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
    # At arrival nothing is known: the view assumes linear scaling, so all 4 GPUs go.
    t0, curves0 = policy.seen[0]
    assert t0 == 0.0 and curves0["j"] == (0.0, 1.0, 2.0, 3.0, 4.0)
    models = events_of(sim.log, ev.ThroughputModelUpdated)
    assert len(models) == 1
    at, update = models[0]
    # After 30 s on 4 GPUs the profiler has measured the allocatable units 1, 2, 4.
    assert at == 30.0
    true = job.throughput
    assert update.throughput[1] == pytest.approx(true[1])
    assert update.throughput[2] == pytest.approx(true[2])
    assert update.throughput[4] == pytest.approx(true[4])
    # 3 is estimated, capped by the measured 4 (never above a measured larger count).
    assert update.throughput[3] == pytest.approx(true[4])
    assert update.overestimated is False
    # The policy re-decides on the update and shrinks the job to 2 GPUs, paying the
    # scale-in stop like any other change.
    shares = events_of(sim.log, ev.SharesDecided)
    assert [(t, e.shares, e.trigger) for t, e in shares] == [
        (0.0, {"j": 4}, "arrival"),
        (30.0, {"j": 2}, "model_update"),
    ]
    assert result.summary["reconfigurations"] == 1
    assert result.summary["lost_gpu_s"] == pytest.approx(2.0 * 2)
    # 30 s at 1.96/s, 2 s stopped, the rest at 1.9/s.
    done_at_30 = 30 * true[4]
    assert job.spec.total_iterations is not None
    expected = 32 + (job.spec.total_iterations - done_at_30) / true[2]
    assert result.jobs[0].completion_s == pytest.approx(expected, abs=1)


def test_a_job_is_measured_again_only_on_a_new_share() -> None:
    jobs = load_workload("philly:2869ce:60", seed=0)
    cfg = SimConfig(profiling="overestimate")
    sim = Simulator(jobs, ToyEqual(), cfg)
    result = sim.run()
    updates = [e for _, e in events_of(sim.log, ev.ThroughputModelUpdated)]
    assert result.summary["model_updates"] == len(updates) > 0
    # Measurements only ever grow, and each published value at a measured count is true.
    true = {j.job_id: j.throughput for j in jobs}
    for update in updates:
        for k, value in update.throughput.items():
            if value != pytest.approx(true[update.job_id][k]):
                # An estimated count is never below the truth (an overestimate).
                assert value >= true[update.job_id][k] * (1 - 1e-9)
    oracle = Simulator(jobs, ToyEqual(), SimConfig()).run()
    # ToyEqual ignores curves, so hiding them changes nothing but the log.
    assert oracle.summary["avg_jct_s"] == result.summary["avg_jct_s"]
    assert oracle.final_digest != result.final_digest


def test_unknown_profiling_mode() -> None:
    with pytest.raises(ValueError, match="profiling"):
        Simulator([], ToyEqual(), SimConfig(profiling="psychic"))

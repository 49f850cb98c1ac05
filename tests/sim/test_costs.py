"""One reconfiguration cost model (issue 23, point 4): calibrated from bench_reconfig.py, charged
by the simulator, and the same in SideCar's predictions (point 5)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
from shoal.models import ThroughputCurve
from shoal.policies.base import ClusterView, Decision
from shoal.policies.sidecar import SideCarAdaptive, _Job
from shoal.sim.calibration import fit, parse_records
from shoal.sim.costs import charge, classify, get_costs, load_calibration, measured
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import make_job

from tests.sim.toy_policies import ToyEqual

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "benchmarks" / "reports" / "reconfiguration.md"
LINEAR = ThroughputCurve(model="linear", throughput=(0.0, 1.0, 2.0, 3.0, 4.0))


def test_calibration_is_the_fit_of_the_benchmark_report() -> None:
    text = REPORT.read_text()
    data = load_calibration()
    assert data["source"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert data["model"] == fit(parse_records(text))


def test_measured_costs_charge_what_the_benchmark_measured() -> None:
    c = measured()
    # bench_reconfig.py: in-place 1 -> 2 lost 9.52 worker-s, 2 -> 4 lost 27.71 (prepare phase).
    assert charge(c, "scale_out", 1, 2, rate_old=1, rate_new=2).lost_gpu_s == pytest.approx(9.52, rel=0.02)
    assert charge(c, "scale_out", 2, 4, rate_old=2, rate_new=4).lost_gpu_s == pytest.approx(27.71, rel=0.02)
    # Graceful scale-in stops milliseconds; checkpoint-restart 5-16 s.
    assert charge(c, "scale_in", 4, 2).stop_s < 0.1
    assert 4.5 < charge(c, "restart", 2, 1).stop_s < 9  # measured 5.3
    assert 14 < charge(c, "restart", 2, 4).stop_s < 18
    # The prepare phase runs on the old rate: the equivalent stop is a fraction of it.
    out = charge(c, "scale_out", 2, 4, rate_old=2, rate_new=4)
    assert out.stop_s == pytest.approx(c.prepare_time(4) / 2 + c.scale_out_s)


def test_a_move_to_disjoint_gpus_is_a_checkpoint_restart() -> None:
    assert classify(2, 2, True, True) == "restart"
    assert classify(2, 4, True, True) == "restart"
    assert classify(2, 2, True) == "migrate"
    c = measured()
    assert charge(c, "restart", 2, 2).stop_s == pytest.approx(c.restart_time(2))
    assert charge(get_costs("restart"), "scale_out", 2, 4).stop_s == 30.0  # every resize restarts


def test_topology_default_charges_the_prepare_phase_and_restart_on_resume() -> None:
    # A: 400 iterations (4/s on 4 GPUs); B arrives at 20 needing 100 iterations.
    jobs = [make_job("a", 0, 100.0, 4, LINEAR), make_job("b", 20, 100.0, 1, LINEAR)]
    sim = Simulator(jobs, ToyEqual(), SimConfig(total_gpus=4, gpus_per_node=4))
    result = sim.run()
    c = measured()
    assert sim.costs == c
    # t=20: A 4 -> 2 (graceful scale-in), B starts (a trace's first start is free) and is
    # done at 70; t=70: A 2 -> 4, its new workers prepare while it trains on 2.
    a_done = 80 + 2 * (50 - c.scale_in_s)
    stop = c.prepare_time(4) * (1 - 2 / 4) + c.scale_out_s
    done = {o.job_id: o.completion_s for o in result.jobs}
    assert done == {"a": math.ceil(70 + stop + (400 - a_done) / 4), "b": 70.0}
    lost = 2 * c.scale_in_s + 4 * c.scale_out_s + 2 * c.prepare_time(4)
    assert result.summary["lost_gpu_s"] == pytest.approx(lost)
    assert result.summary["lost_gpu_s"] > 25  # the coddl preset charged 0.3 here


class _Recorder:
    """SideCar, recording each decision's view."""

    def __init__(self, policy: SideCarAdaptive) -> None:
        self.policy = policy
        self.name = policy.name
        self.elastic = getattr(policy, "elastic", True)
        self.decisions: list[tuple[ClusterView, Decision]] = []

    def planning_costs(self) -> Any:
        return self.policy.planning_costs()

    def bind_costs(self, costs: Any) -> None:
        self.policy.bind_costs(costs)

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        d = self.policy.decide(view, memory)
        # The simulator's view is valid for this decision only (LiveJobs): keep a copy.
        self.decisions.append((msgspec.structs.replace(view, jobs=tuple(view.jobs)), d))
        return d


@pytest.mark.parametrize("costs", ["sidecar-paper", "measured", "termination-paper"])
def test_sidecar_predictions_are_what_the_simulator_charges(costs: str) -> None:
    curve = ThroughputCurve(model="resnet", throughput=(0.0, 1.0, 1.7, 2.0, 2.4))
    jobs = [
        make_job("j1", 0, 600.0, 4, curve),
        make_job("j2", 180, 500.0, 2, curve),
        make_job("j3", 400, 300.0, 1, curve),
    ]
    rec = _Recorder(SideCarAdaptive(costs=costs))
    sim = Simulator(jobs, rec, SimConfig(total_gpus=4, flat=True))
    assert sim.costs == get_costs(costs)
    result = sim.run()
    done = {o.job_id: o.completion_s for o in result.jobs}
    # For every job, the prediction made at its last change is its completion.
    last: dict[str, float] = {}
    for view, d in rec.decisions:
        for jv in view.jobs:
            share = d.shares.get(jv.job_id, 0)
            if share and share != jv.current_gpus:
                j = _Job(jv, 0, rec.policy.options(jv))
                last[jv.job_id] = view.now_s + rec.policy._finish(j, share, view.gpus_per_node)
    assert set(last) == set(done)
    changed = sum(
        1
        for view, d in rec.decisions
        for jv in view.jobs
        if jv.current_gpus and d.shares.get(jv.job_id, 0) not in (0, jv.current_gpus)
    )
    assert changed > 0  # a running job was reshaped
    for job_id, predicted in last.items():
        assert done[job_id] == math.ceil(predicted - 1e-6), job_id


def test_simulator_refuses_a_planner_with_other_costs() -> None:
    jobs = [make_job("a", 0, 10.0, 1, LINEAR)]
    with pytest.raises(ValueError, match="plans with"):
        Simulator(jobs, SideCarAdaptive(costs="restart"), SimConfig(total_gpus=4, costs=get_costs("coddl")))

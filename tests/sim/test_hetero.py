"""Heterogeneous clusters, users and tickets in the simulator."""

from __future__ import annotations

import pytest
from shoal import events as ev
from shoal.fairness.policy import GandivaFairPolicy
from shoal.models import ThroughputCurve
from shoal.sim.engine import SimConfig, Simulator, parse_cluster
from shoal.state import fold
from shoal.workloads import load_workload, make_job

from tests.sim.toy_policies import ToyFifo, ToyTyped

SLOW = ThroughputCurve(model="m", gpu_type="slow", throughput=(0.0, 1.0, 2.0, 3.0, 4.0))
FAST = ThroughputCurve(model="m", gpu_type="fast", throughput=(0.0, 4.0, 8.0, 12.0, 16.0))


def one_job(requested: int, duration: float = 100.0):
    return make_job("j0", 0, duration, requested, SLOW, by_type={"slow": SLOW, "fast": FAST})


def test_parse_cluster_forms_and_errors() -> None:
    assert parse_cluster("64xK80, 24xP100,12xV100") == {"K80": 64, "P100": 24, "V100": 12}
    assert parse_cluster("k80=8,v100=4") == {"k80": 8, "v100": 4}
    for bad in ("", "64", "0xk80", "-4xk80", "4xk80,4xk80", "4x", "4xk 80"):
        with pytest.raises(ValueError):
            parse_cluster(bad)


def test_uneven_nodes_rejected() -> None:
    with pytest.raises(ValueError, match="do not split"):
        Simulator([one_job(1)], ToyFifo(), SimConfig(cluster={"slow": 6, "fast": 4}, gpus_per_node=4))


@pytest.mark.parametrize(
    ("types", "finish"),
    [(None, 25.0), (("slow",), 100.0), (("fast",), 25.0)],
)
def test_progress_uses_the_given_generation(types: tuple[str, ...] | None, finish: float) -> None:
    # 100 iterations (100 s at 1 slow GPU); a fast GPU does 4 iterations/s.
    job = one_job(1)
    assert job.spec.total_iterations == 100
    sim = Simulator([job], ToyTyped(types), SimConfig(cluster={"slow": 4, "fast": 4}, gpus_per_node=4))
    result = sim.run()
    assert result.jobs[0].completion_s == finish
    shares = [e.event for e in sim.log.envelopes if isinstance(e.event, ev.SharesDecided)]
    assert shares[0].gpu_types == {"j0": "fast" if finish == 25.0 else "slow"}


def test_untyped_gang_over_two_generations_runs_at_the_slowest_pace() -> None:
    # 4 GPUs requested on a flat 2 slow + 2 fast cluster: the gang spans both
    # generations and runs at min(slow[4], fast[4]) = 4 iterations/s.
    job = make_job("j0", 0, 100.0, 4, SLOW, by_type={"slow": SLOW, "fast": FAST})
    sim = Simulator([job], ToyFifo(), SimConfig(cluster={"slow": 2, "fast": 2}, flat=True))
    result = sim.run()
    assert result.jobs[0].completion_s == 100.0
    placed = [e.event for e in sim.log.envelopes if isinstance(e.event, ev.PlacementDecided)]
    assert {g.node_id for g in placed[0].placements["j0"]} == {"pool-slow", "pool-fast"}


def check_generations(sim: Simulator) -> int:
    """Replay the log: every placement keeps each job on its decided generation and
    never hands out a GPU twice. Returns the number of placements checked."""
    node_type = {}
    gpu_types: dict[str, str] = {}
    checked = 0
    for env in sim.log.envelopes:
        e = env.event
        if isinstance(e, ev.NodeRegistered):
            for info in e.gpus:
                node_type[(e.node_id, info.index)] = info.gpu_type
        elif isinstance(e, ev.SharesDecided):
            gpu_types = dict(e.gpu_types)
        elif isinstance(e, ev.PlacementDecided):
            seen = set()
            for job_id, gpus in e.placements.items():
                for g in gpus:
                    key = (g.node_id, g.index)
                    assert key in node_type
                    assert key not in seen
                    seen.add(key)
                    if gpu_types.get(job_id):
                        assert node_type[key] == gpu_types[job_id], (job_id, key)
            checked += 1
    return checked


def test_gandiva_fair_runs_on_a_heterogeneous_cluster() -> None:
    jobs = load_workload("poisson:n=25,rate=40,users=3,catalog=gavel,mean_duration_s=900", seed=3)
    tickets = {"user-0": 100, "user-1": 200, "user-2": 100}
    cfg = SimConfig(cluster=parse_cluster("8xk80,4xp100,4xv100"), gpus_per_node=4, users=tickets)
    sim = Simulator(jobs, GandivaFairPolicy(), cfg, trace="poisson-gavel")
    result = sim.run()
    assert result.summary["completed"] == len(jobs)
    assert result.summary["unplaced_decisions"] == 0
    state = sim.log.state
    assert {u: s.tickets for u, s in state.users.items() if s.registered} == tickets
    assert check_generations(sim) > 0
    # Every job ran on at least one generation and decisions named generations.
    assert any(e.event.gpu_types for e in sim.log.envelopes if isinstance(e.event, ev.SharesDecided))
    # The trades the policy reports are in the log and folded into the state.
    traded = [e.event for e in sim.log.envelopes if isinstance(e.event, ev.TradeExecuted)]
    assert set(state.trades) == {t.trade_id for t in traded}
    # The log replays to the same state.
    from shoal.state import digest

    assert digest(fold(sim.log.envelopes)) == result.final_digest


def test_user_shares_add_up_to_the_gpu_time_used() -> None:
    jobs = load_workload("poisson:n=30,rate=30,users=2,catalog=gavel,mean_duration_s=900", seed=5)
    cfg = SimConfig(cluster=parse_cluster("8xk80,8xv100"), gpus_per_node=4)
    result = Simulator(jobs, ToyTyped(), cfg).run()
    shares = result.user_shares
    assert shares is not None
    received = shares.gpu_seconds(0.0, result.summary["makespan_s"] + jobs[0].submit_time_s)
    total = sum(v for per_type in received.values() for v in per_type.values())
    assert total == pytest.approx(result.summary["gpu_s_used"], rel=1e-9)
    assert set(received) == {j.spec.user for j in jobs}
    assert set().union(*received.values()) <= {"k80", "v100"}
    # Cumulative GPU-seconds end at the same totals.
    end = result.summary["makespan_s"]
    cum = shares.cumulative(50, 0.0, end)
    for user, per_type in cum["gpu_s"].items():
        for gpu_type, row in per_type.items():
            assert row == sorted(row)
            assert row[-1] == pytest.approx(received[user][gpu_type], rel=1e-9)

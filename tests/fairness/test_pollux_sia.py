"""Gandiva_fair on the Pollux/Sia measured curves (T4, V100, A100), through the simulator:
the heterogeneous catalog the Gavel runs of the report do not exercise."""

from __future__ import annotations

from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.workloads import load_workload


def test_gandiva_fair_on_pollux_sia_generations_completes_and_uses_every_generation() -> None:
    jobs = load_workload("poisson:n=40,rate=30,users=2,catalog=pollux-sia,reference=V100-32GB", seed=3)
    assert {j.spec.user for j in jobs} == {"user-0", "user-1"}
    assert all({"T4", "V100-32GB", "A100-40GB"} <= set(j.throughput_by_type) for j in jobs)
    config = SimConfig(
        cluster={"T4": 8, "V100-32GB": 4, "A100-40GB": 4},
        gpus_per_node=4,
        users={"user-0": 100, "user-1": 300},
    )
    result = Simulator(jobs, make_policy("gandiva-fair"), config).run()
    assert result.summary["completed"] == len(jobs)
    assert result.user_shares is not None
    held = result.user_shares.gpus
    # Both users ran on every generation at some point (profiling and trading need it).
    for user in ("user-0", "user-1"):
        assert {g for g, series in held[user].items() if max(series) > 0} == {"T4", "V100-32GB", "A100-40GB"}

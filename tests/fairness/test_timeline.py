"""Per-user timelines read back from a simulation log, and the fairness metrics on them."""

from __future__ import annotations

import pytest
from shoal import events as ev
from shoal.codec import wrap
from shoal.fairness.policy import GandivaFairPolicy
from shoal.fairness.timeline import build_timeline, user_fairness, windows
from shoal.models import ThroughputCurve
from shoal.sim import SimConfig, Simulator
from shoal.workloads import make_job


def test_table2_through_the_simulator_is_fair_per_window_but_not_per_instant() -> None:
    curve = ThroughputCurve(model="m", gpu_type="k80", throughput=(0.0, 1.0, 2.0, 3.0, 4.0))
    jobs = [
        make_job(
            f"{u}{k}",
            0.0,
            36_000.0,
            s,
            curve,
            user=u,
            cap_at_request=True,
            elastic=False,
            by_type={"k80": curve},
        )
        for u, s in (("A", 1), ("B", 2), ("C", 4))
        for k in (1, 2)
    ]
    cfg = SimConfig(total_gpus=4, gpus_per_node=4, gpu_type="k80", max_time_s=360.0)
    sim = Simulator(jobs, GandivaFairPolicy(), cfg)
    sim.run()
    tl = build_timeline(sim.log.envelopes, {j.job_id: j.throughput_by_type for j in jobs}, end=360.0)
    assert tl.gens == ["k80"] and tl.total_gpus == 4
    for u in ("A", "B", "C"):
        # 6 quanta of Table 2: 1.33 GPUs each on average, and 1.33 is the fair share.
        assert tl.integral(tl.held[u]) / 360.0 == pytest.approx(4 / 3)
        assert tl.fair[u][0] == pytest.approx(4 / 3)
    per_window = {f.user: f for f in user_fairness(tl, window_s=360.0)}
    per_instant = {f.user: f for f in user_fairness(tl, window_s=0.0)}
    for u in ("A", "B", "C"):
        assert per_window[u].share_deviation == pytest.approx(0.0, abs=1e-9)
        assert per_window[u].progress_ratio == pytest.approx(1.0)
        assert per_instant[u].share_deviation > 0.1
    # C's 4-GPU gang runs 1 quantum in 6: all or nothing, the instant view swings most.
    assert per_instant["C"].share_deviation > per_instant["A"].share_deviation
    # The windows cover exactly the active time.
    assert sum(w[0] for w in windows(tl, "C", window_s=60.0).values()) == pytest.approx(360.0)


def test_gang_over_two_generations_counts_at_the_slowest_and_unplaced_job_falls_short() -> None:
    k80 = (0.0, 1.0, 1.8)
    v100 = (0.0, 5.0, 9.0)
    log = [
        ev.NodeRegistered(
            node_id="k", gpus=(ev.GpuInfo(index=0, gpu_type="k80"), ev.GpuInfo(index=1, gpu_type="k80"))
        ),
        ev.NodeRegistered(
            node_id="v", gpus=(ev.GpuInfo(index=0, gpu_type="v100"), ev.GpuInfo(index=1, gpu_type="v100"))
        ),
        ev.JobSubmitted(
            job_id="a1", spec=ev.JobSpec(user="a", requested_gpus=2, max_gpus=2, total_iterations=9)
        ),
        ev.JobSubmitted(
            job_id="b1", spec=ev.JobSpec(user="b", requested_gpus=2, max_gpus=2, total_iterations=9)
        ),
        ev.SharesDecided(epoch=1, shares={"a1": 2, "b1": 2}),
        ev.PlacementDecided(epoch=1, placements={"a1": (ev.GpuRef("k", 0), ev.GpuRef("v", 0))}),
    ]
    envelopes = [wrap(e, at=0.0, event_id=f"e{i}") for i, e in enumerate(log)]
    envelopes.append(wrap(ev.JobCompleted(job_id="a1"), at=100.0, event_id="done"))
    curves = {j: {"k80": k80, "v100": v100} for j in ("a1", "b1")}
    tl = build_timeline(envelopes, curves, end=100.0)
    assert tl.gens == ["v100", "k80"]
    assert tl.held_by_gen["a"]["k80"][0] == 2.0  # mixed gang: paced by the K80
    assert tl.rate["a"][0] == pytest.approx(2.0)
    assert tl.held["b"][0] == 0.0  # the placer left b1 out: it holds nothing
    fair = {f.user: f for f in user_fairness(tl, window_s=0.0)}
    assert fair["a"].shortfall == 0.0
    assert fair["b"].shortfall == pytest.approx(0.5)  # 2 GPUs of 4 below its fair share
    assert fair["b"].share_deviation == pytest.approx(0.5)
    # Entitlement newest first: 1 V100 + 1 K80 each, worth 9/1.8 = 5 and 1 normalised K80s.
    assert tl.entitled["b"]["v100"][0] == 1.0 and tl.entitled["b"]["k80"][0] == 1.0
    assert tl.entitled_rate["b"][0] == pytest.approx(6.0)
    assert fair["b"].progress_ratio == 0.0

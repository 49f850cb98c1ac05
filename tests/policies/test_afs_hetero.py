"""HeteroAFS: AFS-P's eq. (3) per generation, leases, trading across generations."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.policies.afs import AFSP
from shoal.policies.afs_hetero import HeteroAFS, eq3_prefers
from shoal.policies.base import ClusterView, Decision, JobView, Policy, check_decision

from tests.policies.checked import CheckedAtEveryDecision, run_checked


def linear(rate: float, max_gpus: int) -> tuple[float, ...]:
    return (0.0, *(rate * k for k in range(1, max_gpus + 1)))


def job(job_id: str, speedup: float = 1.0, arrival: float = 0.0, max_gpus: int = 1, **kw: Any) -> JobView:
    """A job whose V100 rate is ``speedup`` times its K80 rate at every count."""
    k80 = linear(1.0, max_gpus)
    return JobView(
        job_id=job_id,
        arrival_s=arrival,
        min_gpus=1,
        max_gpus=max_gpus,
        requested_gpus=1,
        throughput=k80,
        throughput_by_type={"k80": k80, "v100": linear(speedup, max_gpus)},
        **kw,
    )


def decide(policy: Policy, view: ClusterView, memory: dict[str, Any] | None = None) -> Decision:
    d = policy.decide(view, memory or {})
    check_decision(view, d)
    return d


def test_eq3_gives_the_gpu_to_the_job_with_the_larger_relative_gain() -> None:
    # b: 1 -> 2 GPUs doubles its throughput; a: 1 -> 2 adds 10 %.
    assert eq3_prefers(1.0, 2.0, 1.0, 1.1)
    assert not eq3_prefers(1.0, 1.1, 1.0, 2.0)
    # Neither way holds for two equally scaling jobs (AFS-P then prefers the larger p'/p).
    assert not eq3_prefers(1.0, 2.0, 1.0, 2.0)
    # A job with no GPU is never beaten (it is first in line).
    assert not eq3_prefers(1.0, 2.0, 0.0, 1.0)


def test_homogeneous_cluster_is_afs_p_stage_two() -> None:
    scales = JobView(job_id="scales", throughput=linear(1.0, 8), max_gpus=8, arrival_s=0.0)
    saturates = JobView(
        job_id="saturates", throughput=(0.0, 1.0, 1.05, 1.08, 1.1, 1.1, 1.1, 1.1, 1.1), max_gpus=8
    )
    view = ClusterView(now_s=0.0, total_gpus=8, jobs=(scales, saturates))
    d = decide(HeteroAFS(), view)
    # Each gets one GPU, then eq. (3) sends every spare GPU to the job that scales.
    assert d.shares == {"scales": 7, "saturates": 1}
    assert d.gpu_types == {}


def test_jobs_beyond_the_gpus_share_by_leases_in_counter_order() -> None:
    jobs = tuple(JobView(job_id=f"j{i}", arrival_s=float(i), throughput=(0.0, 1.0)) for i in range(3))
    view = ClusterView(now_s=0.0, total_gpus=2, jobs=jobs)
    policy = HeteroAFS(unit_s=100.0)
    first = decide(policy, view)
    assert first.shares == {"j0": 1, "j1": 1}
    assert first.memory["next_decision_at_s"] == 100.0
    # Mid-lease nothing is preempted (non-preemptive within a lease).
    mid = decide(policy, msgspec.structs.replace(view, now_s=50.0), first.memory)
    assert mid.shares == first.shares
    # At expiry j0 and j1 have one lease served; j2 (none) runs, then j0 (arrival).
    after = decide(policy, msgspec.structs.replace(view, now_s=100.0), mid.memory)
    assert after.shares == {"j0": 1, "j2": 1}
    assert after.memory["counters"] == {"j0": 1, "j1": 1}


def test_trading_gives_fast_gpus_to_the_jobs_with_the_largest_speedup() -> None:
    # The low-speedup jobs arrive first and take the V100s; trades swap them out.
    jobs = (job("lo1", 1.25, 0.0), job("lo2", 1.25, 1.0), job("hi1", 6.0, 2.0), job("hi2", 6.0, 3.0))
    view = ClusterView(now_s=0.0, total_gpus=4, jobs=jobs, gpus_by_type={"v100": 2, "k80": 2})
    d = decide(HeteroAFS(), view)
    assert d.gpu_types == {"hi1": "v100", "hi2": "v100", "lo1": "k80", "lo2": "k80"}
    assert {(s["buyer"], s["seller"]) for s in d.memory["swaps"]} == {("hi1", "lo2"), ("hi2", "lo1")}
    # Normalised K80 units: 2 × 6 + 2 × 1 = 14 against 2 × 1.25 + 2 × 1 = 4.5 untraded.
    again = decide(HeteroAFS(), view, d.memory)
    assert again.gpu_types == d.gpu_types and again.memory["swaps"] == []


def test_no_trade_below_the_hysteresis() -> None:
    jobs = (job("a", 5.0, 0.0), job("b", 5.2, 1.0))
    view = ClusterView(now_s=0.0, total_gpus=2, jobs=jobs, gpus_by_type={"v100": 1, "k80": 1})
    d = decide(HeteroAFS(min_gain=0.1), view)
    assert d.gpu_types == {"a": "v100", "b": "k80"} and d.memory["swaps"] == []
    d = decide(HeteroAFS(min_gain=0.0), view)
    assert d.gpu_types == {"a": "k80", "b": "v100"}


def test_spare_gpus_follow_eq3_within_each_generation() -> None:
    # Both jobs start on V100 (their best generation); eq. (3) then sends the two
    # spare V100s to the job that scales there: (8-4)/8 > (4.2-4)/4, (12-8)/12 > 0.05.
    scales = job("scales", 4.0, 0.0, max_gpus=4)
    flat_v100 = JobView(
        job_id="flat",
        arrival_s=1.0,
        max_gpus=4,
        throughput=linear(1.0, 4),
        throughput_by_type={"k80": (0.0, 1.0), "v100": (0.0, 4.0, 4.2, 4.3, 4.3)},
    )
    view = ClusterView(now_s=0.0, total_gpus=5, jobs=(scales, flat_v100), gpus_by_type={"v100": 4, "k80": 1})
    d = decide(HeteroAFS(), view)
    assert d.gpu_types == {"scales": "v100", "flat": "v100"}
    assert d.shares == {"scales": 3, "flat": 1}
    # The idle K80 would slow either job down (normalised 1 < 4), so nobody moves.
    assert d.memory["moves"] == []


def test_an_idle_generation_takes_the_job_that_gains_most_there() -> None:
    # One V100 user at its maximum of 2 V100s; 8 idle K80s run a low-speedup job
    # 8 × 1 / (2 × 1.25) = 3.2× faster, so it moves; the 6× job stays.
    lo = job("lo", 1.25, 0.0, max_gpus=8)
    hi = JobView(
        job_id="hi",
        arrival_s=1.0,
        max_gpus=8,
        throughput=linear(1.0, 8),
        throughput_by_type={"k80": linear(1.0, 8), "v100": linear(6.0, 2)},
    )
    view = ClusterView(now_s=0.0, total_gpus=12, jobs=(lo, hi), gpus_by_type={"v100": 4, "k80": 8})
    d = decide(HeteroAFS(), view)
    assert d.gpu_types == {"lo": "k80", "hi": "v100"}
    assert d.shares == {"lo": 8, "hi": 2}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.5, 8.0), st.integers(1, 8), st.integers(1, 4), st.booleans()),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 6),
    st.integers(0, 8),
    st.booleans(),
)
def test_any_cluster_gets_valid_deterministic_decisions(
    spec: list[tuple[float, int, int, bool]], v100: int, k80: int, hetero: bool
) -> None:
    jobs = tuple(
        JobView(
            job_id=f"j{i}",
            arrival_s=float(i % 5),
            min_gpus=min_g,
            max_gpus=max(min_g, max_g),
            requested_gpus=min_g,
            elastic=elastic,
            throughput=linear(1.0, max(min_g, max_g)),
            throughput_by_type={"k80": linear(1.0, max(min_g, max_g)), "v100": linear(sp, max(min_g, max_g))},
        )
        for i, (sp, max_g, min_g, elastic) in enumerate(spec)
    )
    by_type = {"v100": v100, "k80": k80} if hetero else {}
    total = v100 + k80 if hetero else v100
    view = ClusterView(now_s=0.0, total_gpus=total, jobs=jobs, gpus_by_type=by_type)
    memory: dict[str, Any] = {}
    runs = []
    for _ in range(2):
        memory = {}
        seen = []
        for t in (0.0, 3600.0, 7200.0, 7300.0):
            v = msgspec.structs.replace(view, now_s=t)
            d = decide(HeteroAFS(), v, memory)
            memory = msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
            seen.append((d.shares, d.gpu_types))
            if hetero:
                assert set(d.gpu_types) == set(d.shares)
        runs.append(seen)
    assert runs[0] == runs[1]
    # Work conserving on a homogeneous pool of 1-GPU-minimum jobs: no GPU is idle
    # while some job could still use one.
    if not hetero and all(j.min_gpus == 1 and j.elastic for j in jobs):
        used = sum(runs[0][0][0].values())
        assert used == min(total, sum(j.max_gpus for j in jobs))


def test_registry_name() -> None:
    assert HeteroAFS.name == "afs-het"
    with pytest.raises(ValueError):
        HeteroAFS(unit_s=0)
    with pytest.raises(ValueError):
        HeteroAFS(min_gain=-1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.floats(0.1, 3.0), min_size=1, max_size=6),
            st.integers(1, 3),
            st.booleans(),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=14,
    ),
    st.integers(1, 12),
)
def test_on_a_homogeneous_cluster_it_decides_exactly_as_afs_p(
    spec: list[tuple[list[float], int, bool, int]], gpus: int
) -> None:
    """Generations aside, HeteroAFS is AFS-P: same leases, counters and eq. (3) picks."""
    jobs = []
    for i, (gains, min_g, elastic, arrival) in enumerate(spec):
        curve = [0.0, 1.0]
        for g in gains:  # gains below 1 make flat or falling curves too
            curve.append(curve[-1] * (0.5 + g / 2))
        jobs.append(
            JobView(
                job_id=f"j{i}",
                arrival_s=float(arrival),
                min_gpus=min(min_g, len(curve) - 1),
                max_gpus=len(curve) - 1,
                requested_gpus=min(min_g, len(curve) - 1),
                elastic=elastic,
                throughput=tuple(curve),
            )
        )
    ours, theirs = HeteroAFS(unit_s=100.0), AFSP(unit_s=100.0)
    mem_o: dict[str, Any] = {}
    mem_t: dict[str, Any] = {}
    for t in (0.0, 50.0, 100.0, 250.0, 300.0):
        view = ClusterView(now_s=t, total_gpus=gpus, jobs=tuple(jobs))
        a, b = decide(ours, view, mem_o), decide(theirs, view, mem_t)
        assert a.shares == b.shares
        assert a.memory["counters"] == b.memory["counters"]
        assert a.memory["leases"] == b.memory["leases"]
        mem_o, mem_t = a.memory, b.memory


def test_the_simulator_runs_it_through_the_policy_interface() -> None:
    """Six 1-GPU jobs on 4 V100 + 4 K80: the three with a 6× V100 speedup end up on the V100s."""
    from shoal import events as ev
    from shoal.models import ThroughputCurve
    from shoal.sim import SimConfig, Simulator
    from shoal.workloads import make_job

    jobs = []
    for i, speedup in enumerate((1.25, 1.25, 1.25, 6.0, 6.0, 6.0)):
        by_type = {
            g: ThroughputCurve(model=f"m{speedup}", gpu_type=g, throughput=(0.0, rate))
            for g, rate in (("k80", 1.0), ("v100", speedup))
        }
        jobs.append(make_job(f"j{i}", float(i), 3600.0, 1, by_type["k80"], elastic=False, by_type=by_type))
    cfg = SimConfig(cluster={"v100": 4, "k80": 4}, gpus_per_node=4)
    sim = Simulator(jobs, HeteroAFS(), cfg)
    result = sim.run()
    assert result.summary["completed"] == 6
    decided = [e.event for e in sim.log.envelopes if isinstance(e.event, ev.SharesDecided)]
    # Once all six have arrived (t = 5 s), the trades have put the 6× jobs on the V100s.
    at_five = next(d for d in decided if len(d.shares) == 6)
    on_v100 = {j for j, g in at_five.gpu_types.items() if g == "v100"}
    assert len(on_v100) == 4 and on_v100 >= {"j3", "j4", "j5"}
    # j4 and j5 arrive on the K80s and each swaps once with a 1.25× job; nothing oscillates.
    assert sum(len(d.policy_memory["swaps"]) for d in decided) == 2


def test_keeping_phase_ones_afs_p_between_decisions_changes_no_decision() -> None:
    """6214e9's first jobs queue up behind long runners (AFS-P's leases and counters at
    work, hundreds waiting) on the 16 x 4 topology; 2869ce on a flat pool; Gandiva_fair's
    §5.5 workload on its heterogeneous cluster, where phases 2 and 4 trade and move."""
    from shoal.fairness.workloads import SECTION55_GPUS, section55_workload
    from shoal.sim import SimConfig, Simulator

    traded = 0

    def against_a_fresh_one(v: ClusterView, memory: Any, d: Decision) -> None:
        nonlocal traded
        fresh = HeteroAFS().decide(v, memory)
        assert fresh == d
        # In order too: the memory goes into the log, whose digest the equality harness reads.
        assert list(fresh.shares.items()) == list(d.shares.items())
        assert [list(m.items()) if isinstance(m, dict) else m for m in fresh.memory.values()] == [
            list(m.items()) if isinstance(m, dict) else m for m in d.memory.values()
        ]
        traded += len(d.memory["swaps"]) + len(d.memory["moves"])

    for trace, flat in (("philly:6214e9:300", False), ("philly:2869ce:120", True)):
        assert run_checked(HeteroAFS(), against_a_fresh_one, trace, flat).decisions > 100
    jobs = section55_workload(jobs_per_user=24, resnet_source="gavel")
    traded = 0
    policy = CheckedAtEveryDecision(HeteroAFS(), against_a_fresh_one)
    cfg = SimConfig(cluster=dict(SECTION55_GPUS), gpus_per_node=4, retain_log=False)
    Simulator(jobs, policy, cfg).run()
    assert policy.decisions > 20 and traded > 0


def test_a_pick_no_generation_holds_leaves_phase_ones_afs_p_deciding_as_a_fresh_one() -> None:
    """AFS-P picks ``c`` (3 GPUs of 4) but neither 2-GPU generation holds it: it gets no
    lease, so the memory handed back is not the one phase one's AFS-P returned, and the
    lease holders it kept must not be taken (else it starts jobs a fresh instance does not)."""
    fast = {"v100": 2.0, "e": 5.0}

    def rigid(job_id: str, arrival: float, gpus: int, elastic: bool = False) -> JobView:
        k80 = linear(1.0, gpus + 2)
        return JobView(
            job_id=job_id,
            arrival_s=arrival,
            min_gpus=gpus,
            max_gpus=gpus + 2 if elastic else gpus,
            requested_gpus=gpus,
            elastic=elastic,
            throughput=k80,
            throughput_by_type={"k80": k80, "v100": linear(fast.get(job_id, 2.0), gpus + 2)},
        )

    jobs = (
        rigid("a", 0, 2),
        rigid("b", 1, 2),
        rigid("c", 2, 3),
        rigid("d", 3, 1, True),
        rigid("e", 4, 1, True),
    )
    kept = HeteroAFS(unit_s=100.0)
    memory: dict[str, Any] = {}
    dropped = 0
    for t in range(0, 800, 25):
        v = ClusterView(now_s=float(t), total_gpus=4, jobs=jobs, gpus_by_type={"v100": 2, "k80": 2})
        d = decide(kept, v, memory)
        assert d == HeteroAFS(unit_s=100.0).decide(v, memory)
        picked = AFSP(unit_s=100.0, wake_at_every_lease_end=True).decide(v, memory).shares
        dropped += "c" in picked and "c" not in d.shares
        memory = d.memory
    assert dropped > 10

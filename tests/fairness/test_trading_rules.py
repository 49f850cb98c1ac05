"""Gandiva_fair trading rules (issue 23): measured profiles only, homogeneous users only,
and no trade leaves its seller worse off."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal import events as ev
from shoal import state as shoal_state
from shoal.fairness.hetero import profiled_rate
from shoal.fairness.policy import GandivaFairPolicy
from shoal.fairness.trader import Trade, homogeneous_user, trade_gains, trading_round, undo_trades
from shoal.policies.base import ClusterView, JobView, check_decision
from shoal_services.trader.service import market

ORDER = ("v100", "k80")


def job(job_id: str, user: str, size: int = 1, **kw: Any) -> JobView:
    return JobView(
        job_id=job_id, user=user, requested_gpus=size, min_gpus=size, max_gpus=size, elastic=False, **kw
    )


def view_of(speed: dict[str, dict[str, float]]) -> ClusterView:
    """12 V100 + 60 K80; each job declares its true curve (the model table)."""
    jobs = tuple(
        job(
            f"{j}",
            j.split("-")[0],
            arrival_s=float(i),
            throughput_by_type={g: (0.0, r) for g, r in speed[j].items()},
        )
        for i, j in enumerate(sorted(speed))
    )
    return ClusterView(
        now_s=0.0, total_gpus=72, jobs=jobs, gpus_per_node=4, gpus_by_type={"v100": 12, "k80": 60}
    )


def run_jobs(
    policy: GandivaFairPolicy, speed: dict[str, dict[str, float]], quanta: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Decide ``quanta`` quanta; each scheduled job progresses at ``speed[job][generation]``
    per GPU. Returns every decision's memory."""
    view = view_of(speed)
    done = dict.fromkeys(speed, 0.0)
    memory: dict[str, Any] = {}
    memories = []
    for q in range(quanta):
        jobs = tuple(msgspec.structs.replace(j, iterations_done=done[j.job_id]) for j in view.jobs)
        v = msgspec.structs.replace(view, now_s=60.0 * q, jobs=jobs)
        d = policy.decide(v, memory)
        check_decision(v, d)
        memory = msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
        memories.append(memory)
        for j, n in d.shares.items():
            done[j] += speed[j][d.gpu_types[j]] * n * 60.0
    return memories, []


def table3_jobs(users: dict[str, float], per_user: int = 40) -> dict[str, dict[str, float]]:
    return {f"{u}-{k:02d}": {"k80": 1.0, "v100": s} for u, s in users.items() for k in range(per_user)}


def test_no_trade_on_declared_curves_before_any_profile() -> None:
    # Issue 23: trading started at t = 0 on the declared speedups (the model table).
    speed = table3_jobs({"A": 1.25, "B": 5.0, "C": 6.25})
    view = view_of(speed)
    d = GandivaFairPolicy().decide(view, {})
    assert d.memory["trades_executed"] == []
    # Once measured, the trades follow the measured speedups (A sells its V100s).
    memories, _ = run_jobs(GandivaFairPolicy(), speed, 4)
    executed = [t for m in memories for t in m["trades_executed"]]
    assert executed and all(t["seller"] == "A" for t in executed)


def test_a_user_with_heterogeneous_jobs_does_not_trade_unless_relaxed() -> None:
    speed = table3_jobs({"A": 1.25, "B": 5.0, "C": 6.25})
    # Half of C's jobs are another model (1.5x on V100): C is no sweep of one job.
    for k in range(20):
        speed[f"C-{k:02d}"] = {"k80": 1.0, "v100": 1.5}
    memories, _ = run_jobs(GandivaFairPolicy(), speed, 6)
    executed = [t for m in memories for t in m["trades_executed"]]
    assert all("C" not in (t["buyer"], t["seller"]) for t in executed)
    relaxed, _ = run_jobs(GandivaFairPolicy(homogeneous_only=False), speed, 6)
    assert any("C" in (t["buyer"], t["seller"]) for m in relaxed for t in m["trades_executed"])


def test_homogeneous_user_rule() -> None:
    assert homogeneous_user([1, 1], [{"v100": 5.0, "k80": 1.0}, {"v100": 5.3}])
    assert not homogeneous_user([1, 2], [{"v100": 5.0}, {"v100": 5.0}])
    assert not homogeneous_user([1, 1], [{"v100": 5.0}, {"v100": 6.0}])
    assert not homogeneous_user([], [])


def test_the_trader_service_leaves_out_a_user_with_heterogeneous_jobs() -> None:
    state = shoal_state.ClusterState()
    events: list[ev.Event] = [
        ev.NodeRegistered(node_id=f"{t}-{i}", gpus=tuple(ev.GpuInfo(index=g, gpu_type=t) for g in range(4)))
        for t, n in (("V100", 3), ("K80", 15))
        for i in range(n)
    ]
    for user, rates in (("A", (1.25, 1.25)), ("C", (6.25, 1.5))):
        events.append(ev.UserRegistered(user=user, tickets=100))
        for k, v100 in enumerate(rates):
            spec = ev.JobSpec(user=user, min_gpus=1, max_gpus=1, requested_gpus=1, elastic=False)
            events.append(ev.JobSubmitted(job_id=f"{user}-{k}", spec=spec))
            events.append(
                ev.ThroughputModelUpdated(
                    job_id=f"{user}-{k}", gpu_type="K80", throughput={1: 10.0}, samples=3
                )
            )
            events.append(
                ev.ThroughputModelUpdated(
                    job_id=f"{user}-{k}", gpu_type="V100", throughput={1: 10.0 * v100}, samples=3
                )
            )
    for e in events:
        shoal_state.apply_event(state, e, 0.0)
    assert set(market(state, now=1.0).rates) == {"A"}
    assert set(market(state, now=1.0, homogeneity_tolerance=10.0).rates) == {"A", "C"}


_rate = st.floats(0.2, 10.0, allow_nan=False, allow_infinity=False)


@st.composite
def _markets(
    draw: st.DrawFn,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    users = [f"u{i}" for i in range(draw(st.integers(2, 4)))]
    ent = {u: {"v100": float(draw(st.integers(0, 6))), "k80": float(draw(st.integers(0, 20)))} for u in users}
    rates = {u: {"k80": 1.0, "v100": draw(_rate)} for u in users}
    drift = {u: {g: r * draw(st.floats(0.8, 1.25)) for g, r in rates[u].items()} for u in users}
    return ent, rates, drift


@settings(max_examples=150, deadline=None)
@given(_markets())
def test_no_trade_leaves_its_seller_worse_off(case: Any) -> None:
    ent, rates, drift = case
    trades: list[Trade] = trading_round(ent, rates, ORDER, max_trades_per_pair=None)
    for t in trades:
        buyer, seller = trade_gains(t, rates)
        assert seller >= -1e-9 and buyer >= -1e-9
    # Speedups drift: every trade kept by the undo check still leaves its seller no worse off.
    kept, _ = undo_trades(ent, trades, drift)
    for t in kept:
        assert trade_gains(t, drift)[1] >= -1e-9


@settings(max_examples=8, deadline=None)
@given(st.dictionaries(st.sampled_from("ABC"), st.floats(1.0, 8.0), min_size=2, max_size=3))
def test_through_the_policy_no_kept_trade_loses_for_its_seller(speedups: dict[str, float]) -> None:
    speed = table3_jobs(speedups, per_user=30)
    memories, _ = run_jobs(GandivaFairPolicy(), speed, 6)
    for m in memories:
        measured = {u: {g: profiled_rate(s) or 0.0 for g, s in p.items()} for u, p in m["profiles"].items()}
        for t in m["trades"]:
            assert trade_gains(Trade(**t), measured)[1] >= -1e-9

"""trader against a real nats-server: Gandiva_fair Table 3 trading and undo on arrival."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, fold_log
from shoal.fairness.trader import holdings
from shoal_services.trader.service import TradeParams, TraderService, market

pytestmark = pytest.mark.integration


class ManualClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(0)


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def nodes(gpu_type: str, count: int, per_node: int = 4) -> list[ev.NodeRegistered]:
    return [
        ev.NodeRegistered(
            node_id=f"{gpu_type}-{i}",
            gpus=tuple(ev.GpuInfo(index=g, gpu_type=gpu_type) for g in range(per_node)),
        )
        for i in range(count // per_node)
    ]


def user_jobs(user: str, n: int) -> list[ev.Event]:
    out: list[ev.Event] = [ev.UserRegistered(user=user, tickets=100)]
    for i in range(n):
        spec = ev.JobSpec(user=user, min_gpus=1, max_gpus=1, requested_gpus=1, elastic=False)
        out.append(ev.JobSubmitted(job_id=f"{user}-{i}", spec=spec))
    return out


def profile(job_id: str, gpu_type: str, rate: float) -> ev.ThroughputModelUpdated:
    return ev.ThroughputModelUpdated(job_id=job_id, gpu_type=gpu_type, throughput={1: rate}, samples=3)


# Gandiva_fair Table 3: K80 rate 1 for all; V100 speedups 1.25 (A), 5 (B), 6.25 (C).
SPEEDUP = {"A": 1.25, "B": 5.0, "C": 6.25}


def table3() -> list[ev.Event]:
    events: list[ev.Event] = [*nodes("V100", 12), *nodes("K80", 60)]
    for user, jobs in (("A", 40), ("B", 24), ("C", 24)):
        events += user_jobs(user, jobs)
        events += [profile(f"{user}-0", "K80", 10.0), profile(f"{user}-0", "V100", 10.0 * SPEEDUP[user])]
    return events


async def run_trader(trader: TraderService, until: Any) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(trader.run(stop))
    try:
        await wait_until(until)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_table3_trades_at_the_second_price_then_undoes_on_arrival(bus: Bus) -> None:
    await bus.publish_many(table3())
    clock = ManualClock()
    trader = TraderService(
        bus, holder="t1", clock=clock, quantum_s=60.0, params=TradeParams(max_trades_per_pair=None)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(trader.run(stop))
    try:
        await wait_until(lambda: trader.rounds >= 1)
        state = trader.projection.state
        trades = [t for t in state.trades.values() if t.undone_at is None]
        # C (6.25) buys V100s from A (1.25), paying B's speedup: 5 K80 per V100.
        assert len(trades) == 4
        assert {(t.buyer, t.seller, t.fast_type, t.slow_type) for t in trades} == {("C", "A", "V100", "K80")}
        assert all(t.price == 5.0 and (t.fast_gpus, t.slow_gpus) == (1, 5) for t in trades)
        m = trader.market()
        held = holdings(m.entitlements, list(m.active))
        assert held == {
            "A": {"V100": 0.0, "K80": 40.0},
            "B": {"V100": 4.0, "K80": 20.0},
            "C": {"V100": 8.0, "K80": 0.0},
        }
        # A new user D arrives: fair shares drop to 3 V100 + 15 K80 each, so A no
        # longer has the 4 V100s it sold and C cannot pay 20 K80: a trade is undone.
        checks = trader.checks
        await bus.publish_many(user_jobs("D", 24))
        await wait_until(lambda: trader.undone >= 1 and trader.checks > checks)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    state, _ = await fold_log(bus, st.ClusterState(), st.apply)
    undone = [e.event async for _, e in bus.replay() if isinstance(e.event, ev.TradeUndone)]
    assert [u.trade_id for u in undone] == ["tx-3"]
    assert "needs its V100 GPUs back" in undone[0].reason
    assert state.trades["tx-3"].undone_at is not None
    after = market(state, now=clock.now())
    for user, gens in holdings(after.entitlements, list(after.active)).items():
        assert all(v >= 0 for v in gens.values()), (user, gens)


async def test_one_trade_per_pair_per_quantum(bus: Bus) -> None:
    await bus.publish_many(table3())
    clock = ManualClock()
    trader = TraderService(bus, holder="t1", clock=clock, quantum_s=60.0, lease_ttl_s=0.6)
    stop = asyncio.Event()
    task = asyncio.create_task(trader.run(stop))
    try:
        await wait_until(lambda: trader.rounds >= 1)
        assert trader.executed == 1
        clock.t += 60.0
        await wait_until(lambda: trader.rounds >= 2)
        assert trader.executed == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    executed = [e.event async for _, e in bus.replay() if isinstance(e.event, ev.TradeExecuted)]
    assert [t.trade_id for t in executed] == ["tx-0", "tx-1"]


async def test_homogeneous_cluster_does_nothing(bus: Bus) -> None:
    events: list[ev.Event] = [*nodes("V100", 8)]
    for user, speedup in (("A", 1.25), ("B", 6.25)):
        events += user_jobs(user, 8)
        events += [profile(f"{user}-0", "V100", 10.0 * speedup)]
    await bus.publish_many(events)
    trader = TraderService(bus, holder="t1", clock=ManualClock())
    await run_trader(trader, lambda: trader.rounds >= 1)
    assert trader.executed == trader.undone == 0
    assert not [e async for _, e in bus.replay() if isinstance(e.event, ev.TradeExecuted | ev.TradeUndone)]


async def test_restart_does_not_trade_twice(bus: Bus) -> None:
    await bus.publish_many(table3())
    clock = ManualClock()
    params = TradeParams(max_trades_per_pair=None)
    first = TraderService(bus, holder="t1", clock=clock, params=params)
    await run_trader(first, lambda: first.rounds >= 1)
    second = TraderService(bus, holder="t2", clock=clock, params=params)
    # A new leader waits a quantum after the newest trade in the log, then re-trades nothing.
    await run_trader(second, lambda: second.is_leader and second.checks >= 1)
    assert second.rounds == 0
    clock.t += 60.0
    third = TraderService(bus, holder="t3", clock=clock, params=params)
    await run_trader(third, lambda: third.rounds >= 1)
    assert first.executed == 4 and second.executed == third.executed == 0
    executed = [e async for _, e in bus.replay() if isinstance(e.event, ev.TradeExecuted)]
    assert len(executed) == 4


def test_users_without_two_profiled_generations_do_not_trade() -> None:
    state = st.ClusterState()
    for e in table3():
        st.apply_event(state, e, 0.0)
    st.apply_event(
        state, ev.ThroughputModelUpdated(job_id="B-0", gpu_type="V100", throughput={1: 50.0}, samples=0), 1.0
    )
    m = market(state, now=1.0)
    assert set(m.rates) == {"A", "C"}
    assert m.rates["C"] == {"V100": 62.5, "K80": 10.0}
    assert m.entitlements["A"] == {"V100": 4.0, "K80": 20.0}
    assert m.active == () and m.trades_so_far == 0


async def test_main_serves_from_settings_until_stopped(bus: Bus, nats_url: str, prefix: str) -> None:
    from shoal.settings import Settings
    from shoal_services.trader.main import serve

    settings = Settings.load(
        env={"SHOAL_NATS_URL": nats_url, "NATS_CREDS": os.environ["NATS_CREDS"], "SHOAL_PREFIX": prefix}
    )
    await bus.publish_many(table3())
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    try:
        executed: list[ev.TradeExecuted] = []
        deadline = asyncio.get_running_loop().time() + 10
        while not executed:
            assert asyncio.get_running_loop().time() < deadline, "no trade executed"
            executed = [e.event async for _, e in bus.replay() if isinstance(e.event, ev.TradeExecuted)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    # Default: one trade per generation pair per quantum (60 s), at the second price.
    assert [(t.buyer, t.seller, t.price) for t in executed] == [("C", "A", 5.0)]


def test_two_users_split_the_surplus_in_whole_gpus() -> None:
    """With no third bidder the price is the mean of the two speedups (3.75 K80 per
    V100 for 1.25 and 6.25), rounded to whole GPUs within 5 %: 11 K80 for 3 V100."""
    from shoal_services.trader.service import decide_trades

    state = st.ClusterState()
    events: list[ev.Event] = [*nodes("V100", 8), *nodes("K80", 40)]
    for user, jobs in (("A", 40), ("C", 24)):
        events += user_jobs(user, jobs)
        events += [profile(f"{user}-0", "K80", 10.0), profile(f"{user}-0", "V100", 10.0 * SPEEDUP[user])]
    for e in events:
        st.apply_event(state, e, 0.0)
    undone, new = decide_trades(market(state, now=0.0), TradeParams(), full_round=True)
    assert undone == []
    assert [(t.buyer, t.seller, t.fast_gpus, t.slow_gpus, t.trade_id) for t in new] == [
        ("C", "A", 3, 11, "tx-0")
    ]
    assert new[0].price == pytest.approx(11 / 3)

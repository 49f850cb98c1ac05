"""Gandiva_fair's trading end to end through the shipped commands: `shoal up --policy
gandiva-fair --gpu-type V100,K80,K80,K80`, two users with tickets and homogeneous jobs
whose V100/K80 speedups differ (their profiles; the emulated jobs run at them, and the
profiler measures them on both generations as Gandiva_fair's profiling moves the jobs),
and the trader service, which trades the high-speedup user V100s for K80s (§3.4) at a
price between the two speedups; the allocator then gives the buyer both V100s."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from shoal import events as ev
from shoal.client import Client
from shoal.commands.run import CLI_ARGV as CLI

from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration

#: iterations/s of one GPU: speedup 3 for fast, 1.2 for slow.
PROFILES = {"fast": {"V100": 3.0, "K80": 1.0}, "slow": {"V100": 1.2, "K80": 1.0}}
JOBS = {"fast": 4, "slow": 6}


async def test_a_high_speedup_user_buys_v100s_from_a_low_speedup_user(tmp_path: Path) -> None:
    flags = ("--gpu-type", "V100,K80,K80,K80")
    async with (
        shoal_up(tmp_path, nodes=4, policy="gandiva-fair", flags=flags) as up,
        await Client.connect(up.url, "shoal", **up.admin()) as client,
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
        for user in PROFILES:
            done = subprocess.run([*CLI, "tickets", user, "100"], env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        for user, n in JOBS.items():
            profile = {t: {1: r} for t, r in PROFILES[user].items()}
            for i in range(n):
                spec = ev.JobSpec(
                    user=user, max_gpus=1, elastic=False, total_iterations=10**7, profile=profile
                )
                await client.submit(spec, job_id=f"{user}-{i}")
        deadline = time.monotonic() + 240
        trade = None
        while trade is None:
            if time.monotonic() >= deadline:
                pytest.fail(f"no trade in 240 s; {await market_report(client)}; {trader_log(tmp_path)}")
            async for batch in client.history():
                for _, env_ in batch:
                    if isinstance(env_.event, ev.TradeExecuted):
                        trade = env_.event
            await asyncio.sleep(2.0)
        assert (trade.buyer, trade.seller, trade.fast_type, trade.slow_type) == (
            "fast",
            "slow",
            "V100",
            "K80",
        )
        assert 1.2 <= trade.price <= 3.0, trade  # between the two users' speedups
        # The allocator acts on it: the buyer's jobs come to hold both V100s at once.
        deadline = time.monotonic() + 60
        while True:
            state = await client.state()
            on_v100 = [
                j
                for j in state.jobs.values()
                if j.spec.user == "fast" and any(g.node_id == "node0" for g in j.placement)
            ]
            if len(on_v100) == 2:
                break
            assert time.monotonic() < deadline, f"the buyer never held both V100s: {len(on_v100)}"
            await asyncio.sleep(0.5)


async def market_report(client: Client) -> str:
    """What the trader reads now (its market) and every job's measured models: why a
    trade did not happen shows here (a user left out as heterogeneous, or a generation
    never measured)."""
    from shoal_services.trader.service import market

    state = await client.state()
    m = market(state, now=state.clock)
    models = {
        job_id: {g: (t.samples, t.throughput) for g, t in job.throughput_models.items()}
        for job_id, job in state.jobs.items()
    }
    return f"traders' rates {m.rates}; entitlements {m.entitlements}; measured models {models}"


def trader_log(tmp_path: Path, lines: int = 40) -> str:
    """The installation's last log lines from or about the trader (its rounds, lease and
    publications), from `shoal up`'s stderr."""
    err = tmp_path / "up.err"
    text = err.read_text(errors="replace") if err.exists() else ""
    about = [line for line in text.splitlines() if "trade" in line.lower()]
    return "trader log: " + " | ".join(about[-lines:])

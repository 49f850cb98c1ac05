"""Emulate vs simulate: replay one trace slice through the live stack and through the simulator.

    python benchmarks/conformance.py --trace philly:0e4a51:40 --policy afs-p --time-scale 5000

Both runs use the same jobs (calibrated curves, seed), policy, cluster and cost model.
Prints the average JCT of each and their relative difference, and how far the
sequences of share decisions agree; ``--output`` writes benchmarks/reports/conformance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal import events as ev
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats
from shoal.policies.base import Policy
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.state import ClusterState
from shoal.workloads import TraceJob, load_workload
from shoal_services.stack import EmulatedStack, StackConfig, replay_trace, summarize


def share_sequence(envs: Sequence[ev.Envelope]) -> list[dict[str, int]]:
    """The distinct successive share maps of a log (epochs renumbered away)."""
    out: list[dict[str, int]] = []
    for env in envs:
        if isinstance(env.event, ev.SharesDecided):
            shares = dict(env.event.shares)
            if not out or out[-1] != shares:
                out.append(shares)
    return out


def sequence_agreement(a: list[dict[str, int]], b: list[dict[str, int]]) -> float:
    """Fraction of decisions in the longer sequence matched in order (LCS / max length)."""
    if not a and not b:
        return 1.0
    n, m = len(a), len(b)
    prev = [0] * (m + 1)
    for i in range(n):
        cur = [0] * (m + 1)
        for j in range(m):
            cur[j + 1] = prev[j] + 1 if a[i] == b[j] else max(prev[j + 1], cur[j])
        prev = cur
    return prev[m] / max(n, m)


def run_sim(
    jobs: Sequence[TraceJob], policy: Policy, nodes: int, gpn: int, costs: str
) -> tuple[dict[str, float], list[ev.Envelope]]:
    from shoal.sim.costs import get_costs

    cfg = SimConfig(total_gpus=nodes * gpn, gpus_per_node=gpn, costs=get_costs(costs), gpu_type="V100")
    sim = Simulator(jobs, policy, cfg)
    result = sim.run()
    return result.summary, list(sim.log.envelopes)


async def run_emulated(
    jobs: Sequence[TraceJob], policy: Policy, nodes: int, gpn: int, costs: str, scale: float, url: str | None
) -> tuple[dict[str, float], list[ev.Envelope], float]:
    server = None
    tmp = tempfile.TemporaryDirectory()
    if url is None:
        server = EmbeddedNats(store_dir=Path(tmp.name))
        server.start()
        url = server.url
    try:
        bus = await Bus.connect(url, prefix=f"conf{int(time.time() * 1000) % 10**8}")
        await bus.declare()
        stack = EmulatedStack(
            bus,
            url,
            policy,
            StackConfig(
                nodes=nodes,
                gpus_per_node=gpn,
                gpu_type="V100",
                time_scale=scale,
                costs=costs,
                report_every_s=2.0,
            ),
        )
        await stack.start()
        t0 = time.monotonic()
        try:
            await replay_trace(stack, jobs)
        finally:
            await stack.stop()
        wall = time.monotonic() - t0
        envs = [env async for _, env in bus.replay()]
        state = ClusterState()
        from shoal.state import fold

        state = fold(envs)
        await bus.close()
        return summarize(state, [j.job_id for j in jobs], nodes * gpn), envs, wall
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()


def get_policy(name: str, seed: int) -> Policy:
    if name.startswith("toy-"):  # the simulator's test policies (tests/sim/toy_policies.py)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sim"))
        import toy_policies

        return {"toy-fifo": toy_policies.ToyFifo, "toy-equal": toy_policies.ToyEqual}[name]()
    return make_policy(name, seed=seed)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    jobs = load_workload(args.trace, seed=args.seed)
    t0 = jobs[0].submit_time_s
    from msgspec import structs

    jobs = tuple(structs.replace(j, submit_time_s=j.submit_time_s - t0) for j in jobs)
    sim_summary, sim_envs = run_sim(
        jobs, get_policy(args.policy, args.seed), args.nodes, args.gpus_per_node, args.costs
    )
    emu_summary, emu_envs, wall = asyncio.run(
        run_emulated(
            jobs,
            get_policy(args.policy, args.seed),
            args.nodes,
            args.gpus_per_node,
            args.costs,
            args.time_scale,
            args.nats_url,
        )
    )
    a, b = share_sequence(sim_envs), share_sequence(emu_envs)
    return {
        "trace": args.trace,
        "policy": args.policy,
        "jobs": len(jobs),
        "sim_avg_jct_s": sim_summary["avg_jct_s"],
        "emu_avg_jct_s": emu_summary["avg_jct_s"],
        "jct_rel_diff": abs(emu_summary["avg_jct_s"] - sim_summary["avg_jct_s"]) / sim_summary["avg_jct_s"],
        "sim_decisions": len(a),
        "emu_decisions": len(b),
        "decision_agreement": sequence_agreement(a, b),
        "sim_makespan_s": sim_summary["makespan_s"],
        "emu_makespan_s": emu_summary["makespan_s"],
        "emu_completed": emu_summary["completed"],
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="philly:0e4a51:40")
    p.add_argument("--policy", default="afs-p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--costs", default="coddl")
    p.add_argument("--time-scale", type=float, default=5000.0)
    p.add_argument("--nats-url", default=None)
    args = p.parse_args(argv)
    out = compare(args)
    for k, v in out.items():
        print(f"{k:22s} {v:.4g}" if isinstance(v, float) else f"{k:22s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def timeline(envs: Sequence[ev.Envelope], t0: float) -> list[tuple[float, str, dict[str, int]]]:
    out = []
    for env in envs:
        if isinstance(env.event, ev.SharesDecided):
            out.append((env.at - t0, env.event.trigger, dict(env.event.shares)))
    return out

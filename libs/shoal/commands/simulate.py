"""``shoal simulate``: one policy over one workload in the discrete-event simulator.

Example::

    shoal simulate --trace philly:2869ce --policy afs-p --gpus 64 --seed 0 --output out/

shows a progress bar on stderr, then prints a result table. With ``--output DIR`` it
writes ``DIR/results.json`` (see :mod:`shoal.sim.report`). The cluster is 64 GPUs in
servers of 4 by default (network packing and placement); ``--flat`` is the AFS
simulator's flat pool; ``--cluster 64xk80,24xp100,12xv100`` a heterogeneous one.

The cluster flags and their parsing are shared with ``shoal compare``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from shoal.cli import CommandError

PROFILING = ("oracle", "overestimate")


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The flags that describe the simulated cluster and run."""
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=positive_int, help="total GPUs (default 64, or --nodes × --gpus-per-node)")
    g.add_argument("--nodes", type=positive_int, help="number of servers")
    g.add_argument("--gpus-per-node", type=positive_int, default=4, help="GPUs per server (default 4)")
    g.add_argument("--flat", action="store_true", help="a flat pool: no servers, packing or placement (AFS)")
    g.add_argument("--cluster", help="heterogeneous inventory, e.g. 64xk80,24xp100,12xv100")
    g.add_argument(
        "--costs",
        help=(
            "reconfiguration costs: measured, free, coddl, restart, sidecar-paper, termination-paper or "
            "field=seconds,... (default: free if --flat, else measured; gandiva-fair charges its own "
            "suspend/resume, change it with --policy-param costs=NAME)"
        ),
    )
    g.add_argument("--placer", default="min-migration", choices=("min-migration", "consolidated"))
    g.add_argument("--no-packing", action="store_true", help="do not regulate shares to server sizes")
    g.add_argument(
        "--profiling", default="oracle", choices=PROFILING, help="throughput knowledge (CoDDL §4.5)"
    )
    g.add_argument("--tickets", help="users and tickets registered at start, e.g. alice=100,bob=200")
    g.add_argument(
        "--tick", type=positive_float, help="policy re-run period in seconds (default: the policy's)"
    )
    g.add_argument("--max-time", type=positive_float, help="stop at this virtual time (seconds)")
    w = p.add_argument_group("workload and policy")
    w.add_argument("--seed", type=int, default=0, help="seed of the model draw and the policy (default 0)")
    w.add_argument("--limit", type=positive_int, help="keep only the first N jobs of the workload")
    w.add_argument("--cap-at-request", action="store_true", help="hold every job to its requested GPUs")
    w.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="K=V",
        help="policy constructor parameter (repeatable); V is parsed as JSON when it can be",
    )


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["lease_s=7200", "name=x"]`` -> ``{"lease_s": 7200, "name": "x"}``.

    Raises:
        CommandError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--policy-param expects K=V, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def parse_tickets(text: str | None) -> dict[str, int]:
    """``alice=100,bob=200`` -> ``{"alice": 100, "bob": 200}``.

    Raises:
        CommandError: malformed entry or a negative/non-integer ticket count.
    """
    if not text:
        return {}
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        user, sep, tickets = part.partition("=")
        if not sep or not user or not tickets.strip().isdigit():
            raise CommandError(f"--tickets expects user=tickets,... with non-negative integers, got {part!r}")
        out[user.strip()] = int(tickets)
    return out


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~shoal.sim.engine.SimConfig` the cluster flags describe.

    The log keeps no envelopes (``retain_log=False``): ``shoal simulate`` and
    ``shoal compare`` read the folded state, the counts and the series, never an
    envelope, so making and keeping one per event would be work nothing reads.

    Raises:
        CommandError: contradictory or invalid flags.
    """
    from shoal.sim.costs import get_costs
    from shoal.sim.engine import SimConfig, parse_cluster

    gpn = args.gpus_per_node
    cluster = None
    if args.cluster:
        if args.gpus or args.nodes:
            raise CommandError("--cluster gives the GPU counts; do not combine it with --gpus or --nodes")
        try:
            cluster = parse_cluster(args.cluster)
        except ValueError as exc:
            raise CommandError(f"--cluster: {exc}") from None
        total = sum(cluster.values())
    elif args.nodes:
        total = args.nodes * gpn
        if args.gpus and args.gpus != total:
            raise CommandError(
                f"--gpus {args.gpus} disagrees with --nodes {args.nodes} × --gpus-per-node {gpn}"
            )
    else:
        total = args.gpus or 64
    if not args.flat:
        for gpu_type, count in (cluster or {"": total}).items():
            if count % gpn:
                what = f"{count} {gpu_type} GPUs" if gpu_type else f"--gpus {count}"
                raise CommandError(
                    f"{what} do not split into servers of {gpn} (--gpus-per-node); or use --flat"
                )
    try:
        costs = get_costs(args.costs) if args.costs else None
    except ValueError as exc:
        raise CommandError(f"--costs: {exc}") from None
    return SimConfig(
        total_gpus=total,
        gpus_per_node=gpn,
        flat=args.flat,
        cluster=cluster,
        costs=costs,
        placer=args.placer,
        network_packing=not args.no_packing,
        profiling=args.profiling,
        users=parse_tickets(args.tickets),
        tick_s=args.tick,
        max_time_s=args.max_time,
        retain_log=False,
    )


def check_costs(name: str, policy: Any, config: Any, costs_flag: str | None) -> None:
    """Refuse ``--costs`` for a policy that names its own costs (Gandiva_fair's suspend/resume).

    Raises:
        CommandError: the policy's costs and ``--costs`` differ.
    """
    planned = getattr(policy, "planning_costs", None)
    own = planned() if callable(planned) else None
    if own is not None and config.costs is not None and own != config.costs:
        raise CommandError(
            f"--policy {name} is charged its own reconfiguration costs ({own.name!r}); give other costs "
            f"to the policy (--policy-param costs={costs_flag}) instead of --costs"
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate one policy over a trace",
        description="Simulate one allocation policy over a workload in virtual time.",
    )
    p.add_argument(
        "--trace",
        required=True,
        help="workload: philly:<vc>[:<n>], pollux:<set>:<id>:duration_s=<s>, poisson:n=<jobs>,rate=<per h>",
    )
    p.add_argument("--policy", required=True, help=f"policy name: {', '.join(_policy_names())}")
    add_cluster_args(p)
    p.add_argument("--output", type=Path, help="write DIR/results.json")
    p.add_argument("--points", type=positive_int, default=1000, help="series points in results.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    # The simulator, its policies and the report import no structlog (see shoal.cli.main).
    p.set_defaults(func=run, logs=False)


def _policy_names() -> list[str]:
    from shoal.policies.registry import policy_names

    return policy_names()


class ProgressBar:
    """A one-line progress bar on a stream (redrawn in place)."""

    def __init__(self, stream: Any = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.started = time.perf_counter()
        self.last = -1.0

    def __call__(self, done: int, total: int, now: float) -> None:
        t = time.perf_counter()
        if done < total and t - self.last < 0.1:
            return
        self.last = t
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        self.stream.write(
            f"\r[{bar:<{self.width}}] {frac:6.1%} {done}/{total} jobs, "
            f"virtual {now / 86400:7.1f} d, {t - self.started:6.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from shoal.policies.registry import UnknownPolicyError
    from shoal.sim.engine import SimulationStalled, Simulator, make_policy
    from shoal.sim.report import result_to_json, summary_table
    from shoal.workloads import load_workload

    config = config_from_args(args)
    params = parse_params(args.policy_param)
    try:
        jobs = load_workload(args.trace, seed=args.seed, cap_at_request=args.cap_at_request, limit=args.limit)
    except (ValueError, KeyError) as exc:
        raise CommandError(f"--trace: {exc}") from None
    try:
        policy = make_policy(args.policy, params, seed=args.seed)
    except UnknownPolicyError as exc:
        raise CommandError(str(exc)) from None
    except (TypeError, ValueError, ImportError) as exc:
        raise CommandError(f"--policy {args.policy}: {exc}") from None
    check_costs(args.policy, policy, config, args.costs)
    bar = None if args.quiet else ProgressBar()
    try:
        sim = Simulator(jobs, policy, config, trace=args.trace, on_progress=bar)
        result = sim.run()
    except SimulationStalled as exc:
        raise CommandError(f"simulation stalled: {exc}", code=1) from None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    finally:
        if bar is not None:
            bar.close()
    title = f"{result.policy} on {args.trace} ({config.gpus()} GPUs, seed {args.seed})"
    print(summary_table(result.summary, title=title))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        path = args.output / "results.json"
        doc = result_to_json(result, seed=args.seed, points=args.points)
        doc["command"] = "shoal simulate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["simulate"] else ""
        path.write_text(json.dumps(doc, indent=1, allow_nan=False))
        print(f"wrote {path}")
    return 0

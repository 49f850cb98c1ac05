"""``shoal compare``: a policy × trace matrix in parallel processes, with a report.

Example::

    shoal compare --traces philly:2869ce,philly:e13805 --policies afs-p,tiresias-l,max-min \\
        --baseline tiresias-l --workers 2 --output out/compare

writes ``out/compare/report.md`` (average JCT and JCT reduction relative to the
baseline, as in AFS Figure 5), ``results.json``, ``jct_reduction.png``, and per trace a
JCT CDF (``jct_cdf_<trace>.png``) and QL/CE/BI over time (``metrics_<trace>.png``, AFS
Figure 2). The cluster flags are those of ``shoal simulate``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shoal.cli import CommandError
from shoal.commands.simulate import (
    add_cluster_args,
    check_costs,
    config_from_args,
    parse_params,
    positive_float,
    positive_int,
)


def _split(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def split_traces(values: list[str]) -> list[str]:
    """Comma-separated workload specs; a part without ``:`` continues the previous spec
    (``poisson:n=10,rate=5`` stays one spec)."""
    out: list[str] = []
    for v in values:
        for part in (x.strip() for x in v.split(",")):
            if not part:
                continue
            if ":" not in part and out:
                out[-1] += "," + part
            else:
                out.append(part)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="run a policy × trace matrix and plot the comparison",
        description="Simulate every policy on every trace (in parallel processes) and compare them.",
    )
    p.add_argument(
        "--traces", action="append", required=True, help="workload specs, comma-separated (repeatable)"
    )
    p.add_argument(
        "--policies", action="append", required=True, help="policy names, comma-separated (repeatable)"
    )
    p.add_argument("--baseline", help="policy the JCT reductions are relative to (default: the first)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; averages are over seeds (default 0)")
    p.add_argument("--workers", type=positive_int, default=2, help="parallel processes (default 2)")
    p.add_argument("--cpu-limit", type=positive_float, help="stop a cell after this many CPU seconds")
    p.add_argument("--output", type=Path, default=Path("compare-out"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    add_cluster_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.policies.registry import policy_names
    from shoal.sim.compare import write_compare
    from shoal.sim.matrix import RunOutcome, RunSpec, run_matrix
    from shoal.workloads import load_workload

    traces = split_traces(args.traces)
    policies = _split(args.policies)
    unknown = [p for p in policies if p not in policy_names()]
    if unknown:
        raise CommandError(
            f"unknown policies {', '.join(unknown)}; known policies: {', '.join(policy_names())}"
        )
    baseline = args.baseline or policies[0]
    if baseline not in policies:
        raise CommandError(f"--baseline {baseline} is not one of --policies")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise CommandError(f"--seeds expects comma-separated integers, got {args.seeds!r}") from None
    for trace in traces:  # fail fast on a bad trace, before starting processes
        try:
            load_workload(trace, seed=seeds[0] if seeds else 0)
        except (ValueError, KeyError) as exc:
            raise CommandError(f"--traces: {exc}") from None
    config = config_from_args(args)
    params = parse_params(args.policy_param)
    if config.costs is not None:  # fail fast on a policy that names its own costs, too
        from shoal.sim.engine import make_policy

        for name in policies:
            try:
                policy = make_policy(name, params)
            except Exception:  # the run itself reports a policy it cannot build
                continue
            check_costs(name, policy, config, args.costs)
    specs = [
        RunSpec(
            trace=t,
            policy=p,
            params=params,
            seed=s,
            config=config,
            limit=args.limit,
            cap_at_request=args.cap_at_request,
            cpu_limit_s=args.cpu_limit,
        )
        for t in traces
        for p in policies
        for s in seeds
    ]
    total = len(specs)
    done = 0

    def progress(o: RunOutcome) -> None:
        nonlocal done
        done += 1
        state = "ok" if o.ok else ("timeout" if o.timed_out else "FAILED")
        print(
            f"[{done}/{total}] {o.spec.trace} × {o.spec.name} seed {o.spec.seed}: {state} in {o.wall_s:.1f} s",
            file=sys.stderr,
        )

    outcomes = run_matrix(specs, workers=args.workers, on_done=progress)
    text = write_compare(outcomes, baseline, args.output, plots=not args.no_plots)
    print(text)
    print(f"wrote {args.output}/report.md")
    return 0 if all(o.ok for o in outcomes) else 1

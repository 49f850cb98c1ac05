"""What the reconfiguration cost model changes in the AFS reproduction's topology setting.

Issue 23 ("one cost model") moved the topology rows of ``benchmarks/afs_reproduction.py``
from the ``coddl`` costs (AFS §4.3's milliseconds: 0.05 s for every scale-out, scale-in,
migration and restart, no prepare phase) to ``measured`` (shoal's own trainer,
calibrated from ``benchmarks/bench_reconfig.py``: the new workers' prepare phase,
checkpoint-restart for a move to disjoint GPUs and for a resume). This runs the same
cells (64 GPUs as 16 servers of 4, packing, min-migration placement, seed 0) under both
and reports, per VC and policy, the average JCT and the GPU-hours lost to
reconfiguration, so what changed is measured rather than remembered. Where
``afs_reproduction.md`` has the ``measured`` cell stored, the report checks that this run
gives the same average JCT.

Usage::

    python benchmarks/cost_models.py                      # benchmarks/reports/cost_models.md
    python benchmarks/cost_models.py --vcs 2869ce --policies afs-p,srtf --workers 1
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from shoal.sim.costs import get_costs
from shoal.sim.engine import SimConfig
from shoal.sim.matrix import RunOutcome, RunSpec, run_matrix

ROOT = Path(__file__).resolve().parents[1]
CELLS = ROOT / "benchmarks/reports/afs_reproduction/cells"
MODELS = ("coddl", "measured")
VCS = "e13805,2869ce,ed69ec,103959,0e4a51,7f04ca"
POLICIES = "srtf,srsf,afs-l,tiresias-l,max-min,optimus-perfect,afs-p"
MIN_LOST_H = 0.1
"""Lost GPU-hours under ``coddl`` below which no ratio is given (a near-zero denominator)."""


def spec(vc: str, policy: str, model: str) -> RunSpec:
    config = SimConfig(total_gpus=64, gpus_per_node=4, retain_log=False, costs=get_costs(model))
    return RunSpec(trace=f"philly:{vc}", policy=policy, config=config, series_points=2, label=model)


def stored_avg_jct(vc: str, policy: str) -> float | None:
    """The average JCT of afs_reproduction's stored topology cell (seed 0), if any."""
    path = CELLS / f"topology__{vc}__{policy}__s0.json"
    if not path.exists():
        return None
    outcome = json.loads(path.read_text())["outcome"]
    return float(outcome["summary"]["avg_jct_s"]) if outcome["ok"] else None


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else ("=" if a == b else "-")


def render(
    outcomes: dict[tuple[str, str, str], RunOutcome],
    vcs: list[str],
    policies: list[str],
    argv: str,
    wall: float,
) -> str:
    lines = [
        "# Reconfiguration cost models: `coddl` against `measured`",
        "",
        f"Command: `python benchmarks/cost_models.py{argv}` (wall time {wall:.0f} s; machine "
        f"{platform.machine()}, Python {platform.python_version()}, shared with other jobs). Every number "
        "below is computed by that command from simulator runs.",
        "",
        "Setting: the AFS reproduction's `topology` (64 GPUs as 16 servers of 4, network packing, "
        "min-migration placement, seed 0), once with the `coddl` costs (AFS §4.3: 0.05 s per scale-out, "
        "scale-in, migration and restart, no prepare phase; what the topology rows charged before issue 23's "
        "one cost model) and once with `measured` (shoal's trainer, `shoal.sim.costs.measured`, calibrated "
        "from `benchmarks/bench_reconfig.py`; what they charge now). `lost GPU-h`: GPU-hours allocated and "
        "not training (every stop, and the new workers' prepare phase).",
        "",
        "| VC | policy | avg JCT h, coddl | avg JCT h, measured | JCT ratio | lost GPU-h, coddl "
        "| lost GPU-h, measured | lost ratio | reconfigurations (measured) | as afs_reproduction.md |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    jct_ratios: list[float] = []
    lost_ratios: list[float] = []
    same = checked = 0
    for vc in vcs:
        for policy in policies:
            c, m = outcomes[(vc, policy, "coddl")], outcomes[(vc, policy, "measured")]
            if not (c.ok and m.ok):
                lines.append(f"| {vc} | {policy} | {c.error or '-'} | {m.error or '-'} | | | | | | |")
                continue
            cj, mj = c.summary["avg_jct_s"] / 3600, m.summary["avg_jct_s"] / 3600
            cl, ml = c.summary["lost_gpu_s"] / 3600, m.summary["lost_gpu_s"] / 3600
            jct_ratios.append(mj / cj)
            lost = "-"
            if cl >= MIN_LOST_H:
                lost_ratios.append(ml / cl)
                lost = f"{ml / cl:.0f}x"
            stored = stored_avg_jct(vc, policy)
            if stored is None:
                agree = "not stored"
            else:
                checked += 1
                same += stored == m.summary["avg_jct_s"]
                agree = "same" if stored == m.summary["avg_jct_s"] else f"differs ({stored / 3600:.2f} h)"
            lines.append(
                f"| {vc} | {policy} | {cj:.2f} | {mj:.2f} | {_ratio(mj, cj)} | {cl:.2f} | {ml:.1f} | "
                f"{lost} | {m.summary['reconfigurations']:,.0f} | {agree} |"
            )
    lines += ["", "## Summary", ""]
    if jct_ratios:
        lines.append(
            f"- Average JCT, measured / coddl: {min(jct_ratios):.3f}–{max(jct_ratios):.3f} over "
            f"{len(jct_ratios)} cells (median {sorted(jct_ratios)[len(jct_ratios) // 2]:.3f})."
        )
    if lost_ratios:
        lines.append(
            f"- GPU-hours lost to reconfiguration, measured / coddl: {min(lost_ratios):.0f}–"
            f"{max(lost_ratios):.0f}x over the {len(lost_ratios)} cells that lose at least {MIN_LOST_H} "
            "GPU-h under coddl (the others lose almost nothing there: a ratio says little) "
            f"(median {sorted(lost_ratios)[len(lost_ratios) // 2]:.0f}x)."
        )
    lines.append(
        f"- The `measured` runs reproduce afs_reproduction.md's stored topology cells: {same} of {checked} "
        "with the same average JCT, to the last bit."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vcs", default=VCS)
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/reports/cost_models.md")
    args = parser.parse_args(argv)
    vcs, policies = args.vcs.split(","), args.policies.split(",")
    keys = [(vc, p, m) for vc in vcs for p in policies for m in MODELS]
    t0 = time.perf_counter()
    done = run_matrix(
        [spec(*k) for k in keys],
        workers=args.workers,
        on_done=lambda o: print(
            f"{o.spec.trace} {o.spec.policy} {o.spec.label}: {o.cpu_s:.1f} CPU s", flush=True
        ),
    )
    wall = time.perf_counter() - t0
    shown = "".join(
        f" --{k} {v}" for k, v, d in (("vcs", args.vcs, VCS), ("policies", args.policies, POLICIES)) if v != d
    )
    args.out.write_text(render(dict(zip(keys, done, strict=True)), vcs, policies, shown, wall))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Equality harness: the simulator's results at a baseline git ref and at this tree, compared.

A speed change to the simulator (engine, view, fold, policies, placement) must not change
what it computes. This harness records, for a fixed matrix of runs (traces × policies ×
seeds × settings, :data:`RUNS`), everything a run produces:

* the summary (every float exactly, via ``float.hex``) and the event counts,
* the final state digest (:func:`shoal.state.digest`),
* every job's outcome (arrival, completion, JCT, wait, reconfigurations),
* the QL, CE, BI, GPUs-in-use and BI-slope series and the per-user shares,
* a SHA-256 of the whole event log (every envelope, ids and virtual times included;
  runs with seed 0 keep their log, the others run with ``retain_log=False``),

and compares two recordings field by field. ``--baseline REF`` records ``REF`` from a
temporary ``git worktree`` (removed afterwards) by running this same script with that
worktree's ``libs`` first on ``PYTHONPATH``; the script uses only the simulator's public
API (``load_workload``, ``make_policy``, ``Simulator``, ``SimConfig``), so any ref since
that API exists can be the baseline.

Usage::

    python benchmarks/sim_equality.py --baseline main          # record main and this tree, compare
    python benchmarks/sim_equality.py record --out runs.json   # record this tree only
    python benchmarks/sim_equality.py compare A.json B.json    # compare two recordings
    python benchmarks/sim_equality.py --native --report R.md   # source against `shoal native build`

Exit status 0 when every run is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TRACES = ("philly:2869ce:250", "philly:0e4a51:250", "philly:b436b2:120")
"""Slices of three VCs: a light one, a medium one and an overloaded one (long queue)."""
POLICIES = ("srtf", "afs-l", "afs-p", "tiresias-l", "max-min", "fifo", "optimus", "themis")
RUNS: tuple[tuple[str, str, int, bool], ...] = (
    *(
        (trace, policy, seed, flat)
        for trace in TRACES
        for policy in POLICIES
        for seed, flat in ((0, True), (1, False))
    ),
    ("philly:2869ce:120", "gandiva-fair", 0, False),
    ("philly:2869ce:120", "gandiva-fair", 0, True),
    ("s55:4", "gandiva-fair", 0, False),
    ("s55:8", "gandiva-fair", 1, False),
    ("philly:b436b2:120", "gandiva-fair", 1, False),
    ("philly:2869ce:250", "elastic-tiresias", 0, False),
    ("philly:2869ce:250", "srsf-e", 0, True),
    ("philly:2869ce:250", "afs-p-naive", 0, False),
    ("philly:6214e9:400", "afs-p", 0, False),
    ("philly:6214e9:400", "afs-l", 0, True),
    ("philly:6214e9:400", "fifo", 0, False),
    ("philly:2869ce:250", "sidecar", 0, True),
    ("philly:2869ce:250", "sidecar-default-k8s", 1, False),
    ("philly:2869ce:250", "sidecar-termination", 0, False),
    # A long queue (hundreds wait at each decision), where the SideCar policies keep what
    # they read of each job's view between decisions.
    ("philly:6214e9:400", "sidecar", 0, False),
    ("philly:6214e9:400", "sidecar-default-k8s", 1, False),
    ("philly:6214e9:400", "sidecar-termination", 0, True),
    ("philly:6214e9:400", "elastic-tiresias", 0, False),
    # HeteroAFS: phase one's AFS-P kept between decisions, on a long queue and on the
    # §5.5 heterogeneous cluster (trades and moves).
    ("philly:6214e9:400", "afs-het", 0, False),
    ("s55:8", "afs-het", 0, False),
    # SRTF's kept ranking (only rebuilt views ranked again) on a long queue.
    ("philly:6214e9:400", "srtf", 0, False),
    ("philly:6214e9:400", "srsf-e", 1, True),
    # Tiresias-L looking only at rebuilt views for service without a record.
    ("philly:6214e9:400", "tiresias-l", 0, False),
    # Max-Min and Optimus walking the simulator's jobs without a copy of the queue.
    ("philly:6214e9:400", "max-min", 0, False),
    ("philly:6214e9:400", "optimus", 0, True),
    # Themis's kept columns through a long queue (b436b2 is overloaded: most decisions
    # on its first 600 jobs see 128 to 255 active jobs, where the columns rank), and its
    # length-unaware variant.
    ("philly:b436b2:600", "themis", 0, False),
    ("philly:b436b2:300", "themis-unaware", 1, True),
)
"""(trace, policy, seed, flat): 75 runs; seed is the model draw's and the policy's.

``s55:<n>`` is not a trace: it is Gandiva_fair's §5.5 workload (``n`` jobs per user) on
the §5.5 heterogeneous cluster (V100, P100 and K80 servers of 4 GPUs), where profiling,
trading and per-generation placement run (:func:`_workload`)."""


def _workload(trace: str, seed: int) -> tuple[Any, dict[str, Any]]:
    """The jobs of a run and what its :class:`SimConfig` adds for them."""
    from shoal.workloads import load_workload

    if trace.startswith("s55:"):
        from shoal.fairness.workloads import SECTION55_GPUS, section55_workload

        jobs = section55_workload(jobs_per_user=int(trace[4:]), resnet_source="gavel")
        users = dict.fromkeys(sorted({j.spec.user for j in jobs}), 100)
        return jobs, {"cluster": dict(SECTION55_GPUS), "gpus_per_node": 4, "users": users}
    return load_workload(trace, seed=seed), {}


def _hex(x: Any) -> Any:
    return float(x).hex() if isinstance(x, float) else x


def _sha(obj: Any) -> str:
    import msgspec

    return hashlib.sha256(msgspec.json.encode(obj)).hexdigest()


def record_one(trace: str, policy_name: str, seed: int, flat: bool) -> dict[str, Any]:
    """Run one simulation (log retained) and return what it produced."""
    import msgspec
    from shoal.sim.engine import SimConfig, Simulator, make_policy

    jobs, extra = _workload(trace, seed)
    policy = make_policy(policy_name, seed=seed)
    # Runs with seed 0 keep the log (its hash is compared); the others do not, as long
    # traces are run, so both paths of the log are covered.
    retain = seed == 0
    sim = Simulator(jobs, policy, SimConfig(flat=flat, retain_log=retain, **extra), trace=trace)
    c0 = time.process_time()
    result = sim.run()
    cpu = time.process_time() - c0
    log = hashlib.sha256()
    for env in sim.log.envelopes:
        log.update(msgspec.json.encode(env))
    return {
        "key": f"{trace} {policy_name} seed={seed} {'flat' if flat else 'topology'}",
        "summary": {k: _hex(v) for k, v in sorted(result.summary.items())},
        "event_counts": dict(sorted(result.event_counts.items())),
        "digest": result.final_digest,
        "jobs": [[_hex(v) for v in msgspec.structs.astuple(o)] for o in result.jobs],
        "series": {
            name: [_hex(v) for v in getattr(result.series, name)]
            for name in ("t", "ql", "ce", "bi", "gpus_used", "bi_slope")
        },
        "user_shares": _sha(result.user_shares),
        "log_sha256": log.hexdigest() if retain else None,
        "cpu_s": cpu,
    }


def record(out: Path, matching: str = "") -> None:
    """Record every run of :data:`RUNS` (whose key contains ``matching``) into ``out`` (JSON)."""
    import shoal

    runs = []
    for trace, policy, seed, flat in RUNS:
        if matching not in f"{trace} {policy} seed={seed} {'flat' if flat else 'topology'}":
            continue
        runs.append(record_one(trace, policy, seed, flat))
        print(f"  {runs[-1]['key']}: {runs[-1]['cpu_s']:.2f} CPU s", file=sys.stderr, flush=True)
    # Which modules ran compiled (`shoal native build`; none without a build, or at a
    # ref from before shoal.native): a recording says what it recorded.
    try:
        from shoal.native import loaded
    except ImportError:
        compiled: list[str] = []
    else:
        compiled = loaded()
    print(f"  compiled modules: {', '.join(compiled) or 'none'}", file=sys.stderr, flush=True)
    out.write_text(json.dumps({"shoal": shoal.__file__, "compiled": compiled, "runs": runs}))


def compare(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Differences between two recordings, one line per differing field (empty: identical)."""
    diffs = []
    by_key = {r["key"]: r for r in new["runs"]}
    for b in base["runs"]:
        n = by_key.get(b["key"])
        if n is None:
            diffs.append(f"{b['key']}: missing from the new recording")
            continue
        for field in ("summary", "event_counts", "digest", "jobs", "series", "user_shares", "log_sha256"):
            if field == "log_sha256" and None in (b[field], n[field]):
                continue  # a run that did not keep its log
            if b[field] != n[field]:
                detail = ""
                if field == "summary":
                    detail = ", ".join(
                        f"{k}: {b[field].get(k)} -> {n[field].get(k)}"
                        for k in sorted(b[field].keys() | n[field].keys())
                        if b[field].get(k) != n[field].get(k)
                    )
                diffs.append(f"{b['key']}: {field} differs {detail}".rstrip())
    return diffs


def _record_at(ref: str, out: Path, matching: str) -> subprocess.Popen[bytes]:
    """Start recording ``ref`` from a temporary worktree (the caller waits and cleans up)."""
    tmp = Path(tempfile.mkdtemp(prefix="sim-equality-"))
    wt = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), ref], check=True)
    env = dict(os.environ, PYTHONPATH=f"{wt / 'libs'}{os.pathsep}{wt}")
    proc = subprocess.Popen(
        [sys.executable, __file__, "record", "--out", str(out), "--matching", matching], env=env
    )
    proc.worktree = wt  # type: ignore[attr-defined]
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git ref to compare this tree against (e.g. main)")
    parser.add_argument("--baseline-file", type=Path, help="a recording of the baseline (instead of a ref)")
    parser.add_argument("--keep", type=Path, help="directory to keep both recordings in")
    parser.add_argument("--matching", default="", help="only the runs whose key contains this (a smoke run)")
    parser.add_argument(
        "--native",
        action="store_true",
        help="compare this tree run from source (SHOAL_NATIVE=0) with this tree's compiled build "
        "(`shoal native build`) instead of a baseline ref",
    )
    parser.add_argument("--report", type=Path, help="also write the comparison as a Markdown report")
    sub = parser.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="record this tree")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--matching", default="")
    cmp_ = sub.add_parser("compare", help="compare two recordings")
    cmp_.add_argument("base", type=Path)
    cmp_.add_argument("new", type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "record":
        record(args.out, args.matching)
        return 0
    if args.cmd == "compare":
        base, new = (json.loads(p.read_text()) for p in (args.base, args.new))
    elif args.native:
        from shoal.native import status

        state, _ = status()
        if state != "active":
            parser.error(f"--native needs this tree's compiled build (`shoal native build`); it is: {state}")
        keep = args.keep or Path(tempfile.mkdtemp(prefix="sim-equality-out-"))
        keep.mkdir(parents=True, exist_ok=True)
        base_path, new_path = keep / "source.json", keep / "compiled.json"
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'libs'}{os.pathsep}{ROOT}")
        cmd = [sys.executable, __file__, "record", "--matching", args.matching, "--out"]
        # Both at once, one process each (the machine's two cores), as for a baseline ref.
        source = subprocess.Popen([*cmd, str(base_path)], env={**env, "SHOAL_NATIVE": "0"})
        compiled = subprocess.run([*cmd, str(new_path)], env=env, check=False)
        if source.wait() != 0 or compiled.returncode != 0:
            print("a recording failed", file=sys.stderr)
            return 2
        base, new = (json.loads(p.read_text()) for p in (base_path, new_path))
        print(f"recordings in {keep}", file=sys.stderr)
    else:
        if not args.baseline and not args.baseline_file:
            parser.error("give --baseline REF, --baseline-file FILE, --native, or a subcommand")
        keep = args.keep or Path(tempfile.mkdtemp(prefix="sim-equality-out-"))
        keep.mkdir(parents=True, exist_ok=True)
        new_path, base_path = keep / "new.json", args.baseline_file or keep / "baseline.json"
        # Both recordings run at once, one process each (the machine's two cores).
        proc = _record_at(args.baseline, base_path, args.matching) if not args.baseline_file else None
        try:
            subprocess.run(
                [sys.executable, __file__, "record", "--out", str(new_path), "--matching", args.matching],
                check=True,
                env=dict(os.environ, PYTHONPATH=f"{ROOT / 'libs'}{os.pathsep}{ROOT}"),
            )
            if proc is not None and proc.wait() != 0:
                print("recording the baseline failed", file=sys.stderr)
                return 2
        finally:
            if proc is not None:
                proc.wait()
                wt = proc.worktree  # type: ignore[attr-defined]
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False
                )
        base, new = (json.loads(p.read_text()) for p in (base_path, new_path))
        print(f"recordings in {keep}", file=sys.stderr)
    print(f"baseline: {base['shoal']}\nnew:      {new['shoal']}")
    diffs = compare(base, new)
    n = len(base["runs"])
    cpu_b = sum(r["cpu_s"] for r in base["runs"])
    cpu_n = sum(r["cpu_s"] for r in new["runs"])
    for line in diffs:
        print("DIFFERS", line)
    same = n - len({d.split(": ")[0] for d in diffs})
    print(f"{same} of {n} runs identical; simulation CPU s {cpu_b:.1f} (baseline) -> {cpu_n:.1f} (new)")
    if args.report:
        args.report.write_text(_report(base, new, diffs, same, argv))
        print(f"wrote {args.report}", file=sys.stderr)
    return 0 if not diffs else 1


def _report(
    base: dict[str, Any], new: dict[str, Any], diffs: list[str], same: int, argv: list[str] | None
) -> str:
    """The comparison as Markdown: the verdict, what ran compiled, CPU by policy."""
    import platform

    command = " ".join(["python benchmarks/sim_equality.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# Equality: " + ("source against the compiled build" if new.get("compiled") else "two recordings"),
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
        "The two recordings ran at once, one process each; CPU s is `time.process_time` around each "
        "`Simulator.run`, one run each, so a ratio of a few tenths of a second is noise.",
        "",
        "Compared per run: the summary (every float exactly), the event counts, the final state digest, "
        "every job's outcome, the QL/CE/BI, GPUs-in-use and BI-slope series, the per-user shares, and "
        "for the seed-0 runs the SHA-256 of the whole event log (`benchmarks/sim_equality.py`'s docstring).",
        "",
        f"Baseline: {', '.join(base.get('compiled') or []) or 'every module from source'}.",
        "",
        f"New: compiled {', '.join(new.get('compiled') or []) or 'nothing'}.",
        "",
        f"**{same} of {len(base['runs'])} runs identical.**",
        "",
    ]
    if diffs:
        lines += ["Differences:", "", *(f"- {d}" for d in diffs), ""]
    by_policy: dict[str, list[float]] = {}
    for which, rec in enumerate((base, new)):
        for r in rec["runs"]:
            by_policy.setdefault(r["key"].split()[1], [0.0, 0.0])[which] += r["cpu_s"]
    lines += [
        "| policy | runs | CPU s, baseline | CPU s, new | baseline / new |",
        "|---|---:|---:|---:|---:|",
    ]
    for policy, (b, n) in by_policy.items():
        runs = sum(1 for r in base["runs"] if r["key"].split()[1] == policy)
        lines.append(f"| {policy} | {runs} | {b:.2f} | {n:.2f} | {b / n:.2f} |")
    tb, tn = (sum(v[i] for v in by_policy.values()) for i in (0, 1))
    lines += [f"| all | {len(base['runs'])} | {tb:.2f} | {tn:.2f} | {tb / tn:.2f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

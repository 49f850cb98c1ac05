"""Simulation cost in instructions: this tree against a baseline git ref, under callgrind.

CPU seconds on a shared 2-core virtual machine move by 10-20 % between identical runs
(`bench_sim.py` takes medians for that reason), which hides a change worth a few per
cent. The number of instructions a run executes does not move: this script counts them
with valgrind's callgrind (``--cache-sim=no --branch-sim=no``: instructions only), for
each named cell, in a baseline worktree and in this tree, both at once (one process
each). Start-up is taken out by counting the same cell limited to its first job too
and subtracting. A cell's digest of the final state is compared as well: a change that
alters results is reported as such.

Instructions are a proxy, not time: a cache miss or an allocation costs more than an
``add``. Use it to compare two trees on the same cell, and ``bench_sim.py`` for seconds.
Callgrind runs about 50 times slower than a plain run, so cells are prefixes
(``VC:POLICY:SETTING:JOBS``).

    python benchmarks/instructions_sim.py --baseline-ref REF \\
        --cells 7f04ca:afs-p:flat:150,2869ce:srtf:flat:956 --out benchmarks/reports/X.md

Needs ``valgrind`` (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.workloads import load_workload
vc, policy, setting, n = sys.argv[1:5]
jobs = load_workload(f"philly:{vc}", seed=0)[: int(n)]
config = SimConfig(retain_log=False, flat=setting == "flat")
sim = Simulator(jobs, make_policy(policy, {}, seed=0), config, trace=f"philly:{vc}")
result = sim.run()
print(result.final_digest, sim.decisions)
"""


def count(libs: Path, args: list[str]) -> tuple[int, str, int]:
    """(instructions, final digest, decisions) of one child run under callgrind."""
    with tempfile.TemporaryDirectory() as d:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env.update(PYTHONPATH=str(libs), PYTHONHASHSEED="0")
        out = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--cache-sim=no",
                "--branch-sim=no",
                f"--callgrind-out-file={d}/out",
                sys.executable,
                "-c",
                CHILD,
                *args,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind run {args} failed:\n{out.stderr[-2000:]}")
    digest, decisions = out.stdout.split()
    return int(found.group(1)), digest, int(decisions)


def measure(libs: Path, cell: str) -> dict[str, object]:
    """Instructions of a cell less those of its first job alone (start-up and loading)."""
    vc, policy, setting, n = cell.split(":")
    total, digest, decisions = count(libs, [vc, policy, setting, n])
    start, _, _ = count(libs, [vc, policy, setting, "1"])
    return {"instructions": total - start, "digest": digest, "decisions": decisions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-ref", required=True, help="git ref to compare this tree against")
    parser.add_argument(
        "--cells", required=True, help="VC:POLICY:SETTING:JOBS,... (setting: flat or topology)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cells = [c for c in args.cells.split(",") if c]
    for c in cells:
        parts = c.split(":")
        if len(parts) != 4 or parts[2] not in ("flat", "topology") or not parts[3].isdigit():
            parser.error(f"a cell is VC:POLICY:SETTING:JOBS with SETTING flat or topology, got {c!r}")
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (apt-get install valgrind)")
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline_ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", "libs"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    worktree = Path(tempfile.mkdtemp(prefix="instructions-sim-")) / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), sha], check=True)
    rows = []
    try:
        for cell in cells:
            with ThreadPoolExecutor(2) as pool:
                base = pool.submit(measure, worktree / "libs", cell)
                new = pool.submit(measure, ROOT / "libs", cell)
                b, n = base.result(), new.result()
            rows.append((cell, b, n))
            ratio = int(b["instructions"]) / int(n["instructions"])  # type: ignore[call-overload]
            print(f"{cell}: baseline / new = {ratio:.3f}", file=sys.stderr)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)

    cmd = "python benchmarks/instructions_sim.py " + " ".join(argv if argv is not None else sys.argv[1:])
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Simulation cost in instructions",
        "",
        f"Generated by `{cmd}` on {now}.",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, valgrind callgrind "
        "(instructions only). Trees: baseline "
        f"`{args.baseline_ref}` ({sha}); this tree ({head}{'+changes' if dirty else ''}). Each cell is "
        "`Simulator.run` on the VC's first JOBS jobs, seed 0, log not retained, minus the same "
        "process on the first job alone (start-up, imports, loading). Instructions do not vary "
        "between runs; they are a proxy for CPU time, not a measure of it (`bench_sim.py`).",
        "",
        "| cell | decisions | instructions, baseline | instructions, this tree | baseline / this tree "
        "| same final digest |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for cell, b, n in rows:
        bi, ni = int(b["instructions"]), int(n["instructions"])  # type: ignore[call-overload]
        same = "yes" if b["digest"] == n["digest"] else "NO"
        lines.append(
            f"| {cell} | {int(n['decisions']):,} | {bi / 1e9:.3f} G | {ni / 1e9:.3f} G | {bi / ni:.3f} | {same} |"  # type: ignore[call-overload]
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

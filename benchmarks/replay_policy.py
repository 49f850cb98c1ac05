"""A policy alone, on recorded inputs: this tree against a named baseline, decision by decision.

``bench_sim.py`` times whole simulations, where the engine's share and a shared machine's
noise (tens of percent from one run to the next) hide a policy change of a few percent.
This script takes the engine out:

1. **Record** (in this process, this tree): run a simulation and keep the inputs of every
   ``--every``-th call of the policy's ``decide`` up to ``--upto`` calls, the view (its
   jobs copied to a tuple) and the memory it was given, pickled to a file with the
   reconfiguration costs the simulator bound the policy to (a policy with ``bind_costs``,
   such as SideCar's, predicts with them; the replay binds its fresh policy alike). The simulation
   is ``shoal simulate``'s: the VC (or a slice ``philly:<vc>:<n>``, or ``s55:<n>``, the
   Gandiva_fair §5.5 workload of ``sim_equality.py``), seed 0, ``flat`` or the default
   topology.
2. **Replay** (a child process per tree, the trees alternating): call a fresh policy's
   ``decide`` on every recorded input in order. The child hashes what each call returns
   (shares, GPU types and the whole memory, msgpack-encoded, so even the order of a dict
   counts) into one SHA-256, and times the replay (``time.process_time``, the fastest of
   ``--repeat`` passes in one process). With ``--instructions`` it also counts the
   replay's instructions under ``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0``,
   less a run that only loads the recording: a count that does not move with the
   machine's load.

Two trees with the same digest returned the same decision and the same memory on every
recorded input. The recording is made by this tree, so the baseline is asked the same
questions this tree was (a function-by-function check, not a whole run's).

``--step placement`` records and replays the simulator's placement step instead
(:func:`shoal.allocation.place`, which sends a decision that names nodes to
:func:`shoal.placement.hinted.place_hinted`): its inputs are the topology, the
``SharesDecided`` event (its ``policy_memory`` cut to the two keys placement reads,
``node_hints`` and ``gpu_slots``), the GPUs each running job holds and the placer; the
digest is of the ``PlacementDecided`` event and the placer's whole result (placements,
migrations, unplaced jobs). The recording is made by this tree's simulation of
``--policy``.

Only a policy that takes everything it knows from ``memory`` and the view is replayed
faithfully: one that carries state of its own between calls (AFS-L's keys, Tiresias-L's
records, Themis's columns, all keyed to the simulator's live view) sees tuple views here
and takes its full path. Gandiva_fair carries none. SideCar's (each job's predictions,
kept with its view object) is replayed: the recording is one pickle, so a view that
consecutive calls shared is one object again when loaded.

Usage::

    python benchmarks/replay_policy.py --policy gandiva-fair --runs philly:2869ce:200@topology,s55:6@topology \\
        --baseline-ref HEAD~1 --repeat 3 --instructions --out benchmarks/reports/replay_gandiva_fair.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


class _Enough(Exception):
    pass


def record(
    trace: str, setting: str, policy_name: str, every: int, upto: int, out: Path, step: str = "policy"
) -> dict[str, Any]:
    """Run one simulation in this process and pickle the recorded inputs of ``step`` (the
    policy's ``decide`` or the placement step) to ``out``."""
    if step == "placement":
        return _record_placement(trace, setting, policy_name, every, upto, out)
    import msgspec
    from shoal.sim.engine import SimConfig, Simulator, make_policy
    from sim_equality import _workload

    jobs, extra = _workload(trace, 0)
    policy = make_policy(policy_name, seed=0)
    inputs: list[tuple[Any, Any]] = []
    calls = 0
    enc = msgspec.msgpack.Encoder()
    live = hashlib.sha256()  # what the policy returned in the simulation, for the recorded calls

    class Recorder:
        name = policy.name

        def __getattr__(self, attr: str) -> Any:
            return getattr(policy, attr)

        def decide(self, view: Any, memory: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > upto:
                raise _Enough
            kept = calls % every == 0
            if kept:
                inputs.append((msgspec.structs.replace(view, jobs=tuple(view.jobs)), memory))
            d = policy.decide(view, memory)
            if kept:
                live.update(enc.encode([d.shares, d.gpu_types, d.memory]))
            return d

    sim = Simulator(
        jobs, Recorder(), SimConfig(flat=setting == "flat", retain_log=False, **extra), trace=trace
    )
    try:
        sim.run()
    except _Enough:
        pass
    # The costs the simulator bound the policy to (a SideCar policy predicts with them):
    # the replay binds its fresh policy to the same.
    costs = msgspec.structs.asdict(sim.costs) if callable(getattr(policy, "bind_costs", None)) else None
    return _saved(
        out,
        {"inputs": inputs, "costs": costs},
        [len(v.jobs) for v, _ in inputs],
        live.hexdigest(),
        min(calls, upto),
    )


def _saved(out: Path, inputs: Any, jobs: list[int], live: str, seen: int) -> dict[str, Any]:
    """Pickle a recording to ``out`` (the placement step's inputs, or the policy's with the
    costs it was bound to); what :func:`record` returns about it (``jobs``: the jobs of
    each recorded call)."""
    with out.open("wb") as f:
        pickle.dump(inputs, f, protocol=pickle.HIGHEST_PROTOCOL)
    queue = sorted(jobs)
    return {
        "live_digest": live[:16],
        "decisions_seen": seen,
        "recorded": len(jobs),
        "jobs_in_view_median": queue[len(queue) // 2] if queue else 0,
        "jobs_in_view_max": queue[-1] if queue else 0,
    }


def _record_placement(
    trace: str, setting: str, policy_name: str, every: int, upto: int, out: Path
) -> dict[str, Any]:
    """:func:`record` for ``--step placement``: the inputs of every ``every``-th call of the
    simulator's placement step, up to call ``upto``."""
    import msgspec
    import shoal.sim.engine as engine
    from shoal.placement.hinted import NODE_HINTS, NODE_SLOTS
    from sim_equality import _workload

    jobs, extra = _workload(trace, 0)
    inputs: list[tuple[Any, ...]] = []
    calls = 0
    enc = msgspec.msgpack.Encoder()
    live = hashlib.sha256()
    place = engine.place

    def recording(topology: Any, shares: Any, previous: Any, *, placer: str = "min-migration") -> Any:
        nonlocal calls
        calls += 1
        if calls > upto:
            raise _Enough
        result = place(topology, shares, previous, placer=placer)
        if calls % every == 0:
            memory = {
                k: shares.policy_memory[k] for k in (NODE_HINTS, NODE_SLOTS) if k in shares.policy_memory
            }
            inputs.append(
                (topology, msgspec.structs.replace(shares, policy_memory=memory), dict(previous), placer)
            )
            live.update(_placement_bytes(enc, result))
        return result

    engine.place = recording  # type: ignore[assignment]
    try:
        sim = engine.Simulator(
            jobs,
            engine.make_policy(policy_name, seed=0),
            engine.SimConfig(flat=setting == "flat", retain_log=False, **extra),
            trace=trace,
        )
        try:
            sim.run()
        except _Enough:
            pass
    finally:
        engine.place = place  # type: ignore[assignment]
    return _saved(out, inputs, [len(s.shares) for _, s, _, _ in inputs], live.hexdigest(), min(calls, upto))


def _placement_bytes(enc: Any, placed: tuple[Any, Any]) -> bytes:
    """What the digest of a placement step covers: the event and the placer's whole result."""
    event, result = placed
    return bytes(enc.encode([event, result.placements, result.migrations, result.unplaced]))


def _child_placement(inputs: list[tuple[Any, ...]], repeat: int, mode: str) -> None:
    """:func:`child` for a recording of the placement step."""
    from shoal.allocation import place

    if mode == "load":
        return
    if mode == "digest":
        import msgspec

        enc = msgspec.msgpack.Encoder()
        h = hashlib.sha256()
        for topology, shares, previous, placer in inputs:
            h.update(_placement_bytes(enc, place(topology, shares, previous, placer=placer)))
        print(json.dumps({"digest": h.hexdigest()[:16]}))
        return
    best = float("inf")
    for _ in range(repeat if mode == "time" else 1):
        c0 = time.process_time()
        for topology, shares, previous, placer in inputs:
            place(topology, shares, previous, placer=placer)
        best = min(best, time.process_time() - c0)
    if mode == "time":
        print(json.dumps({"cpu_s": best}))


def child(path: str, policy_name: str, repeat: int, mode: str, step: str = "policy") -> None:
    """In a child process: replay the recording at ``path`` (see the module docstring)."""
    with open(path, "rb") as f:
        inputs = pickle.load(f)
    if step == "placement":
        _child_placement(inputs, repeat, mode)
        return
    from shoal.sim.costs import ReconfigCosts
    from shoal.sim.engine import make_policy

    costs = inputs["costs"]
    inputs = inputs["inputs"]

    def make_policy_bound(name: str, seed: int) -> Any:
        """A fresh policy, bound to the costs the simulation bound it to (if it binds any)."""
        policy = make_policy(name, seed=seed)
        if costs is not None:
            policy.bind_costs(ReconfigCosts(**costs))
        return policy

    if mode == "load":
        make_policy_bound(policy_name, 0)
        return
    if mode == "digest":
        import msgspec

        enc = msgspec.msgpack.Encoder()
        h = hashlib.sha256()
        policy = make_policy_bound(policy_name, 0)
        for view, memory in inputs:
            d = policy.decide(view, memory)
            h.update(enc.encode([d.shares, d.gpu_types, d.memory]))
        print(json.dumps({"digest": h.hexdigest()[:16]}))
        return
    best = float("inf")
    for _ in range(repeat if mode == "time" else 1):
        policy = make_policy_bound(policy_name, 0)
        c0 = time.process_time()
        for view, memory in inputs:
            policy.decide(view, memory)
        best = min(best, time.process_time() - c0)
    if mode == "time":
        print(json.dumps({"cpu_s": best}))


class Tree:
    def __init__(self, label: str, root: Path) -> None:
        self.label = label
        self.root = root

    def env(self, hash_seed: bool = False) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env["PYTHONPATH"] = f"{self.root / 'libs'}{os.pathsep}{ROOT / 'benchmarks'}"
        if hash_seed:
            env["PYTHONHASHSEED"] = "0"
        return env

    def run(self, path: Path, policy: str, repeat: int, mode: str, step: str = "policy") -> dict[str, Any]:
        cmd = [sys.executable, __file__, "--child", str(path), policy, str(repeat), mode, step]
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.label}: {proc.stderr.strip().splitlines()[-1:]}")
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

    def instructions(self, path: Path, policy: str, mode: str, step: str = "policy") -> int:
        """Instructions of a child in ``mode`` (``once`` or ``load``), counted by callgrind."""
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--child",
            str(path),
            policy,
            "1",
            mode,
            step,
        ]
        proc = subprocess.run(cmd, env=self.env(hash_seed=True), capture_output=True, text=True, check=False)
        for line in proc.stderr.splitlines():
            if "Collected :" in line:
                return int(line.split()[-1])
        raise RuntimeError(f"{self.label}: callgrind gave no count: {proc.stderr.strip().splitlines()[-1:]}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(
            sys.argv[2],
            sys.argv[3],
            int(sys.argv[4]),
            sys.argv[5],
            sys.argv[6] if len(sys.argv) > 6 else "policy",
        )
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True)
    parser.add_argument(
        "--runs",
        required=True,
        help="TRACE@SETTING[@EVERY[@UPTO]],...: what to record (setting flat or topology)",
    )
    parser.add_argument(
        "--step",
        choices=("policy", "placement"),
        default="policy",
        help="what is recorded and replayed: the policy's decide, or the placement step (--policy's simulation)",
    )
    parser.add_argument("--baseline-ref", default="HEAD", help="git ref replayed beside this tree")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per child (the fastest is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="children per tree, the trees alternating")
    parser.add_argument("--instructions", action="store_true", help="count instructions with callgrind too")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind")

    from bench_sim import _dirty
    from cell_history import _git

    sha = _git("rev-parse", "--short", args.baseline_ref)
    here = _git("rev-parse", "--short", "HEAD")
    tmp = Path(tempfile.mkdtemp(prefix="replay-policy-"))
    worktree = tmp / "baseline"
    _git("worktree", "add", "--detach", str(worktree), sha)
    trees = [
        Tree(f"baseline {args.baseline_ref} ({sha})", worktree),
        Tree(f"this tree ({here}{' + changes' if _dirty() else ''})", ROOT),
    ]
    rows: list[dict[str, Any]] = []
    try:
        for spec in args.runs.split(","):
            parts = spec.split("@")
            trace, setting = parts[0], parts[1]
            every = int(parts[2]) if len(parts) > 2 else 1
            upto = int(parts[3]) if len(parts) > 3 else 10**12
            path = tmp / f"rec{len(rows)}.pkl"
            row: dict[str, Any] = {
                "run": spec,
                **record(trace, setting, args.policy, every, upto, path, args.step),
            }
            for t in trees:
                row[f"digest {t.label}"] = t.run(path, args.policy, 1, "digest", args.step)["digest"]
            for _ in range(args.rounds):
                for t in trees:
                    row.setdefault(f"cpu {t.label}", []).append(
                        t.run(path, args.policy, args.repeat, "time", args.step)["cpu_s"]
                    )
            if args.instructions:
                for t in trees:
                    load = t.instructions(path, args.policy, "load", args.step)
                    row[f"ir {t.label}"] = t.instructions(path, args.policy, "once", args.step) - load
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.write_text(render(args, trees, rows))
    # Fails when the trees disagree, or when this tree's replay is not its simulation's.
    b, n = trees[0].label, trees[1].label
    return 0 if all(r[f"digest {b}"] == r[f"digest {n}"] == r["live_digest"] for r in rows) else 1


def render(args: argparse.Namespace, trees: list[Tree], rows: list[dict[str, Any]]) -> str:
    b, n = trees[0].label, trees[1].label
    cmd = " ".join(["python", "benchmarks/replay_policy.py", *sys.argv[1:]])
    placing = args.step == "placement"
    title = (
        f"# Replaying the placement step of {args.policy}'s simulation on recorded inputs"
        if placing
        else f"# Replaying {args.policy} on recorded inputs"
    )
    recorded = (
        "the inputs of the simulator's placement step (`shoal.allocation.place`: the topology, the "
        "`SharesDecided` event with the node hints and GPU slots, the GPUs each running job holds, the placer) "
        "recorded on a simulation of the policy"
        if placing
        else "the inputs of the policy's `decide` recorded on a simulation"
    )
    digested = (
        "`PlacementDecided` event and placer result (placements, migrations, unplaced; msgpack) is equal. "
        "`jobs` = jobs with a share in the decision."
        if placing
        else "shares, GPU types and memory (msgpack) is equal."
    )
    what = (
        f"What this is (see the script's docstring): {recorded} by this tree (seed 0; `RUN` is "
        "`TRACE@SETTING[@EVERY[@UPTO]]`: every EVERY-th call, up to call UPTO), replayed in order by each tree "
        f"in its own process. `same` = the SHA-256 of every call's {digested} CPU s = the fastest of "
    )
    lines = [
        title,
        "",
        f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}; "
        f"load average at the end {os.getloadavg()[0]:.1f}.",
        "",
        what
        + f"{args.repeat} passes in a child, one child per tree per round, {args.rounds} rounds alternating "
        "(each round listed)."
        + (
            " Instructions = callgrind's count for one pass with `PYTHONHASHSEED=0`, less a child that only "
            "loads the recording and imports the tree's "
            + ("placement step" if placing else "policy")
            + ": it does not move with the machine's load."
            if args.instructions
            else ""
        ),
        "",
        f"Trees: `{b}`; `{n}`.",
        "",
    ]
    jobs_col = "jobs, median / max" if placing else "jobs in view, median / max"
    head = f"| run | calls recorded (of seen) | {jobs_col} | same | CPU s, baseline | CPU s, this tree | ratio (fastest) |"
    sep = "|---|---|---|---|---|---|---:|"
    if args.instructions:
        head += " instructions, baseline (M) | instructions, this tree (M) | ratio |"
        sep += "---:|---:|---:|"
    lines += [head, sep]
    for r in rows:
        cb, cn = r[f"cpu {b}"], r[f"cpu {n}"]
        same = (
            "yes" if r[f"digest {b}"] == r[f"digest {n}"] else f"NO ({r[f'digest {b}']} / {r[f'digest {n}']})"
        )
        if r[f"digest {n}"] != r["live_digest"]:
            same += " (this tree's replay differs from its own simulation: not a faithful replay)"
        line = (
            f"| {r['run']} | {r['recorded']:,} ({r['decisions_seen']:,}) | {r['jobs_in_view_median']} / "
            f"{r['jobs_in_view_max']} | {same} | {', '.join(f'{c:.2f}' for c in cb)} | "
            f"{', '.join(f'{c:.2f}' for c in cn)} | {min(cb) / min(cn):.2f}x |"
        )
        if args.instructions:
            ib, i_n = r[f"ir {b}"], r[f"ir {n}"]
            line += f" {ib / 1e6:,.0f} | {i_n / 1e6:,.0f} | {ib / i_n:.3f}x |"
        lines.append(line)
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Growth of the permanent event log of an installation (issue 21, bounded log growth).

Starts ``shoal up --nodes N`` (the command a user runs; emulated nodes), with ``--jobs K``
submits K one-GPU jobs far too long to finish in the window (0: an idle installation),
lets it settle, then counts the event stream's messages and bytes per subject at the
start and the end of ``--seconds``, and the messages the bounded heartbeat stream
(``<P>_BEATS``, one per node at most) holds. The rate is extrapolated to a day.
``--env KEY=VALUE`` sets one of the installation's ``SHOAL_*`` settings (repeatable):
``SHOAL_REPORT_MAX_EVERY_S=0.25`` gives the fixed progress-report interval of the code
before :mod:`shoal.reporting`.

    .venv/bin/python -m benchmarks.bench_log_growth --label after --seconds 60
    .venv/bin/python -m benchmarks.bench_log_growth --label busy --jobs 8 --seconds 120

Each run is stored under its ``--label`` in ``benchmarks/reports/log_growth.json`` and
``benchmarks/reports/log_growth.md`` is rewritten from every stored run (so a run on the
code before a change and one after it sit side by side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
import nats.js.errors

from benchmarks.bench_services import _commit, _machine

REPORTS = Path(__file__).parent / "reports"
STORE = REPORTS / "log_growth.json"
REPORT = REPORTS / "log_growth.md"


def _kind(subject: str) -> str:
    """``shoal.node.node0.heartbeat`` -> ``node.*.heartbeat`` (per node/job ids folded)."""
    parts = subject.split(".")[1:]
    if len(parts) >= 3 and parts[0] in ("node", "job", "user"):
        parts[1] = "*"
    return ".".join(parts)


async def _count(url: str, creds: str) -> dict[str, Any]:
    nc = await nats.connect(url, nkeys_seed=creds)
    try:
        js = nc.jetstream()
        info = await js.stream_info("SHOAL_EVENTS", subjects_filter=">")
        kinds: dict[str, int] = {}
        for subject, n in (info.state.subjects or {}).items():
            kinds[_kind(subject)] = kinds.get(_kind(subject), 0) + n
        out: dict[str, Any] = {
            "messages": int(info.state.messages),
            "bytes": int(info.state.bytes),
            "kinds": kinds,
        }
        try:
            beats = await js.stream_info("SHOAL_BEATS")
            out["beats_messages"] = int(beats.state.messages)
            out["beats_bytes"] = int(beats.state.bytes)
        except nats.js.errors.NotFoundError:
            out["beats_messages"] = None
        return out
    finally:
        await nc.close()


def _submit(target: Any, jobs: int) -> None:
    """``jobs`` one-GPU jobs of 10^12 iterations, as the user alice, with ``shoal submit``."""
    from shoal.commands.run import CLI_ARGV

    creds = str(Path(target.admin).parent / "user-alice.nk")
    for i in range(jobs):
        spec = ["--name", f"long-{i}", "--min-gpus", "1", "--max-gpus", "1", "--iterations", str(10**12)]
        subprocess.run(
            [*CLI_ARGV, "submit", "--nats-url", target.url, "--creds", creds, *spec, "--job-id", f"long-{i}"],
            check=True,
            capture_output=True,
        )


def measure(
    nodes: int, seconds: float, settle_s: float, jobs: int = 0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    from shoal.audit import local_installation

    with tempfile.TemporaryDirectory() as tmp:
        state_dir = str(Path(tmp) / "state")
        with local_installation(state_dir, nodes=nodes, mqtt=False, env_extra=env) as target:
            # Every node registered and its first GPU readings in (on a busy machine the
            # node daemons may take longer than `shoal up`'s "running" line), then a pause.
            deadline = time.monotonic() + 120
            while True:
                kinds = asyncio.run(_count(target.url, target.admin))["kinds"]
                if (
                    kinds.get("node.*.registered", 0) >= nodes
                    and kinds.get("node.*.gpu_health", 0) >= 4 * nodes
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {nodes} nodes did not register within 120 s: {kinds}")
                time.sleep(0.5)
            _submit(target, jobs)
            while jobs and asyncio.run(_count(target.url, target.admin))["kinds"].get(
                "job.*.reconf.completed", 0
            ) < min(jobs, 4 * nodes):
                if time.monotonic() > deadline + 120:
                    raise RuntimeError(f"the {jobs} jobs did not start within 120 s")
                time.sleep(0.5)
            time.sleep(settle_s)  # not a synchronisation: the measured window starts after it
            first = asyncio.run(_count(target.url, target.admin))
            t0 = time.monotonic()
            time.sleep(seconds)
            last = asyncio.run(_count(target.url, target.admin))
            elapsed = time.monotonic() - t0
    kinds = {
        k: last["kinds"].get(k, 0) - first["kinds"].get(k, 0)
        for k in sorted(set(first["kinds"]) | set(last["kinds"]))
    }
    grown = last["messages"] - first["messages"]
    grown_bytes = last["bytes"] - first["bytes"]
    return {
        "nodes": nodes,
        "jobs": jobs,
        "env": dict(env or {}),
        "seconds": round(elapsed, 1),
        "events_per_s": grown / elapsed,
        "bytes_per_s": grown_bytes / elapsed,
        "events_per_day": grown / elapsed * 86400,
        "bytes_per_day": grown_bytes / elapsed * 86400,
        "kinds_per_s": {k: v / elapsed for k, v in kinds.items() if v},
        "beats_messages": last["beats_messages"],
        "total_messages": last["messages"],
        "commit": _commit(),
        "machine": _machine(),
    }


def render(store: dict[str, Any]) -> str:
    lines = [
        "# Log growth of an installation",
        "",
        "Produced by `python -m benchmarks.bench_log_growth --label <label> --seconds <s> [--jobs K] "
        "[--env KEY=VALUE]`: `shoal up --nodes N` (emulated nodes of 4 GPUs, time scale 10), with *jobs* "
        "one-GPU jobs too long to finish running (0: idle), once every node has registered and sent its "
        "first GPU readings (and the jobs started) a settling pause, then the event stream's "
        "messages and bytes counted at the start and the end of the window. *beats stream* is the "
        "bounded heartbeat stream (`SHOAL_BEATS`, at most one message per node until 2026-11-29, "
        "at most eight since: the per-node rate limit); `-`: it does not exist. "
        "*settings*: the installation's settings other than the defaults.",
        "",
        "| run | commit | nodes | jobs | settings | window s | events/s | bytes/s | events/day | MB/day "
        "| beats stream |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in store.items():
        beats = "-" if r["beats_messages"] is None else str(r["beats_messages"])
        settings = " ".join(f"`{k}={v}`" for k, v in sorted(r.get("env", {}).items())) or "-"
        lines.append(
            f"| {label} | {r['commit']} | {r['nodes']} | {r.get('jobs', 0)} | {settings} | {r['seconds']} "
            f"| {r['events_per_s']:.2f} "
            f"| {r['bytes_per_s']:.0f} | {r['events_per_day']:,.0f} | {r['bytes_per_day'] / 1e6:,.1f} "
            f"| {beats} |"
        )
    lines += ["", "Events per second by subject (node and job ids folded to `*`):", ""]
    for label, r in store.items():
        kinds = ", ".join(f"`{k}` {v:.2f}" for k, v in sorted(r["kinds_per_s"].items())) or "none"
        lines.append(f"- **{label}**: {kinds}")
    lines += ["", f"Machine: {next(iter(store.values()))['machine']}." if store else "", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="name of this run in the report (e.g. before, after)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after start before the window")
    parser.add_argument("--jobs", type=int, default=0, help="long one-GPU jobs running in the window")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="a SHOAL_* setting")
    args = parser.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9_ -]+", args.label):
        parser.error("--label: letters, digits, space, '_' or '-'")
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"SHOAL_[A-Z0-9_]+", key):
            parser.error(f"--env {item!r}: expected SHOAL_NAME=VALUE")
        env[key] = value
    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    store[args.label] = measure(args.nodes, args.seconds, args.settle, args.jobs, env)
    STORE.write_text(json.dumps(store, indent=2) + "\n")
    REPORT.write_text(render(store))
    print(REPORT.read_text())


if __name__ == "__main__":
    main()

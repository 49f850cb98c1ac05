"""What ``shoal compact`` removes, what it keeps, and what it costs (issue 21, bounded log growth).

Fills a fresh installation's log with a cluster's history (:func:`history`): ``--jobs``
jobs, ``--active`` at a time, each submitted, started (``ReconfigurationStarted``),
reporting its progress ``--reports`` times (the job-hours: one report per 30 s at the
default back-off is 120 a job-hour) and completed, with a share decision and its
placement on every arrival and completion (the churn AFS and FIFO decide on; a policy
with a time quantum, Gandiva_fair, also decides once a quantum, which this leaves out). The cluster snapshot goes at the end, as the leading
allocator would write it. Then runs ``shoal compact`` (the command an operator runs, as
the admin, ``--older-than 0``: every report may go) and reports the event stream's messages and bytes before and after, the
messages per job, the command's wall time, and whether a fresh fold of what
is left has the digest of the whole log's fold.

    .venv/bin/python -m benchmarks.bench_compaction --label r10 --jobs 2000 --reports 10
    .venv/bin/python -m benchmarks.bench_compaction --label r100 --jobs 2000 --reports 100

Runs with the same ``--jobs`` and different ``--reports`` show the point: before, the
log grows with the reports (job-hours); after, with the jobs only. Each run is stored
under its ``--label`` in ``benchmarks/reports/compaction.json`` and
``benchmarks/reports/compaction.md`` is rewritten from every stored run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.commands.run import CLI_ARGV
from shoal.events import Envelope, GpuRef
from shoal.nats_server import EmbeddedNats
from shoal.projection import CLUSTER_SNAPSHOT, SNAPSHOT_SCHEMA

from benchmarks.bench_services import _commit, _machine, fake_gpus

REPORTS = Path(__file__).parent / "reports"
STORE = REPORTS / "compaction.json"
REPORT = REPORTS / "compaction.md"
NODES = 64
GPUS_PER_NODE = 4


def history(jobs: int, reports: int, active: int) -> Iterator[Envelope]:
    """The cluster history described in the module docstring, in order."""
    t = 1_700_000_000.0
    refs = [GpuRef(f"node{i // GPUS_PER_NODE}", i % GPUS_PER_NODE) for i in range(NODES * GPUS_PER_NODE)]
    epoch = 0

    def wrap(event: ev.Event) -> Envelope:
        nonlocal t
        t += 0.5
        return codec.wrap(event, at=t)

    for i in range(NODES):
        yield wrap(
            ev.NodeRegistered(node_id=f"node{i}", gpus=fake_gpus(GPUS_PER_NODE, "V100"), emulated=True)
        )
    running: dict[str, int] = {}
    submitted = 0

    def decide() -> Iterator[Envelope]:
        nonlocal epoch
        epoch += 1
        yield wrap(ev.SharesDecided(epoch=epoch, shares=dict.fromkeys(running, 1), policy="fifo"))
        placements = {j: (refs[k % len(refs)],) for k, j in enumerate(running)}
        yield wrap(ev.PlacementDecided(epoch=epoch, placements=placements))

    while running or submitted < jobs:
        arrived = False
        while len(running) < active and submitted < jobs:
            job = f"job-{submitted:07d}"
            submitted += 1
            spec = ev.JobSpec(user=f"u{submitted % 10}", max_gpus=1, total_iterations=reports * 100)
            yield wrap(ev.JobSubmitted(job_id=job, spec=spec))
            yield wrap(ev.ReconfigurationStarted(job_id=job, epoch=epoch + 1, kind="start", to_world=1))
            running[job] = 0
            arrived = True
        if arrived:
            yield from decide()
        for job in list(running):
            done = running[job] + 1
            running[job] = done
            yield wrap(ev.ProgressReported(job_id=job, iteration=done * 100, num_gpus=1, samples_per_s=10.0))
            if done == reports:
                del running[job]
                yield wrap(ev.JobCompleted(job_id=job, iterations=reports * 100))
                yield from decide()


async def _stream(bus: Bus) -> tuple[int, int, str]:
    info = await bus.js.stream_info(bus.names.events_stream)
    state = st.ClusterState()
    async for _, env in bus.replay():
        st.apply(state, env)
    return int(info.state.messages), int(info.state.bytes), st.digest(state)


async def measure(jobs: int, reports: int, active: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        creds = CredentialStore(root / "creds")
        admin = str(creds.ensure("admin"))
        with EmbeddedNats(store_dir=root / "js", creds_dir=creds.directory) as server:
            bus = await Bus.connect(server.url, "shoal", creds=admin)
            try:
                chunk: list[Envelope] = []
                state = st.ClusterState()
                for env in history(jobs, reports, active):
                    st.apply(state, env)
                    chunk.append(env)
                    if len(chunk) == 50_000:
                        await bus.publish_many(chunk, window=4096)
                        chunk = []
                if chunk:
                    await bus.publish_many(chunk, window=4096)
                last = await bus.last_seq()
                await bus.save_snapshot(
                    CLUSTER_SNAPSHOT,
                    last,
                    st.encode_state(state),
                    digest=st.digest(state),
                    schema=SNAPSHOT_SCHEMA,
                )
                before = await _stream(bus)
                env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
                env.update(NATS_URL=server.url, NATS_CREDS=admin)
                t0 = time.perf_counter()
                done = subprocess.run(
                    [*CLI_ARGV, "compact", "--older-than", "0"], env=env, capture_output=True, text=True
                )
                took = time.perf_counter() - t0
                if done.returncode != 0:
                    raise RuntimeError(f"shoal compact failed: {done.stderr}")
                after = await _stream(bus)
            finally:
                await bus.close()
    return {
        "jobs": jobs,
        "reports": reports,
        "active": active,
        "messages_before": before[0],
        "bytes_before": before[1],
        "messages_after": after[0],
        "bytes_after": after[1],
        "digest_equal": before[2] == after[2],
        "compact_s": round(took, 2),
        "output": done.stdout.strip(),
        "commit": _commit(),
        "machine": _machine(),
    }


def render(store: dict[str, Any]) -> str:
    lines = [
        "# `shoal compact`: the log before and after",
        "",
        "Produced by `python -m benchmarks.bench_compaction --label <label> --jobs J --reports R "
        "[--active A]`: a fresh installation's log holds a history of J jobs, A at a time, each "
        "submitted, started, reporting its progress R times and completed, plus a share decision and "
        f"its placement on each arrival and completion, on {NODES} nodes; the cluster snapshot covers all of it. "
        "Then `shoal compact --older-than 0` runs as the admin. *per job*: messages of the event stream per job. "
        "*digest*: a fresh fold of the log after equals the fold before. *compact s*: the command's "
        "wall time (both folds of the log and the purges, Python start included).",
        "",
        "| run | commit | jobs | reports a job | messages before | per job | MB before | messages after "
        "| per job | MB after | digest | compact s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label, r in store.items():
        lines.append(
            f"| {label} | {r['commit']} | {r['jobs']:,} | {r['reports']} | {r['messages_before']:,} "
            f"| {r['messages_before'] / r['jobs']:.1f} | {r['bytes_before'] / 1e6:.1f} "
            f"| {r['messages_after']:,} | {r['messages_after'] / r['jobs']:.1f} "
            f"| {r['bytes_after'] / 1e6:.1f} | {'equal' if r['digest_equal'] else '**differs**'} "
            f"| {r['compact_s']} |"
        )
    lines += ["", "The command's own summary:", ""]
    for label, r in store.items():
        lines.append(f"- **{label}**: {r['output']}")
    lines += ["", f"Machine: {next(iter(store.values()))['machine']}." if store else "", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--reports", type=int, default=10, help="progress reports of each job")
    parser.add_argument("--active", type=int, default=100, help="jobs running at once")
    args = parser.parse_args()
    result = asyncio.run(measure(args.jobs, args.reports, args.active))
    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    store[args.label] = result
    STORE.write_text(json.dumps(store, indent=2, sort_keys=True) + "\n")
    REPORT.write_text(render(store))
    print(render({args.label: result}))


if __name__ == "__main__":
    main()

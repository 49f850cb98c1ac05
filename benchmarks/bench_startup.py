"""Start-up time of every service against a long log, with and without the cluster snapshot.

Fills a fresh installation's log with ``--events`` events (``history_chunks`` of
bench_services: a long-running cluster), folds it once for the reference digest and
stores the cluster snapshot (``shoal.projection.CLUSTER_SNAPSHOT``) ``--tail`` events
before the end, as the leading allocator would. Then starts each service with
``shoal run <service>`` (one at a time) and times spawn -> its ``projection_ready`` log
line (wall, including the Python start) and the projection's own ``elapsed_s`` (snapshot
load + tail replay); each start must reach the reference digest. Then the same without
a snapshot (deleted: a full replay). The profiler has no snapshot (its book needs the
progress reports), so it is timed on a full replay only.

    .venv/bin/python -m benchmarks.bench_startup --events 300000 --tail 1000

Writes ``benchmarks/reports/startup.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal import state as st
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.commands.run import CLI_ARGV
from shoal.nats_server import EmbeddedNats
from shoal.projection import CLUSTER_SNAPSHOT, SNAPSHOT_SCHEMA

from benchmarks.bench_services import _machine, history_chunks

SERVICES: dict[str, dict[str, str]] = {
    "admission": {},
    "placer": {},
    "trader": {},
    "allocator": {},
    "node-daemon": {"SHOAL_NODE_ID": "bench-node", "SHOAL_FAKE_GPUS": "1", "SHOAL_SIDECAR_SPARES": "0"},
    "profiler": {},
}


def start_once(service: str, env: dict[str, str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Spawn ``shoal run service``; the ``projection_ready`` record and spawn->ready wall seconds."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI_ARGV, "run", service], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            for line in log.read_text(errors="replace").splitlines():
                if '"projection_ready"' in line:
                    rec = json.loads(line)
                    rec["wall_s"] = time.perf_counter() - t0
                    return rec
            if proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
                return {"wall_s": None, "error": log.read_text(errors="replace")[-500:]}
            time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    creds = CredentialStore(root / "creds")
    admin = str(creds.ensure("admin"))
    prefix = "bench"
    with EmbeddedNats(store_dir=root / "js", creds_dir=creds.directory, prefix=prefix) as server:
        bus = await Bus.connect(server.url, prefix=prefix, creds=admin)
        t0 = time.perf_counter()
        for chunk in history_chunks(args.events):
            await bus.publish_many(chunk, window=4096)
        fill_s = time.perf_counter() - t0
        last = await bus.last_seq()
        state = st.ClusterState()
        snap_seq = last - args.tail
        async for batch in bus.replay_batches(start_seq=1):
            for seq, env in batch:
                st.apply(state, env)
                if seq == snap_seq:
                    encoded = st.encode_state(state)
                    await bus.save_snapshot(
                        CLUSTER_SNAPSHOT, seq, encoded, digest=st.digest(state), schema=SNAPSHOT_SCHEMA
                    )
        reference = st.digest(state)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env.update(
            SHOAL_NATS_URL=server.url,
            SHOAL_NATS_CREDS=admin,
            SHOAL_PREFIX=prefix,
            SHOAL_STATE_DIR=str(root),
            SHOAL_LOG_FORMAT="json",
            SHOAL_CATALOG="",
            SHOAL_NODE_TIMEOUT_S="1000000000",
            SHOAL_SNAPSHOT_EVERY="1000000000",
            SHOAL_SNAPSHOT_INTERVAL_S="1000000000",
        )
        rows: list[tuple[str, str, dict[str, Any]]] = []
        for mode in ("snapshot", "full replay"):
            if mode == "full replay":
                store = await bus._snapshot_store()
                await store.delete(CLUSTER_SNAPSHOT)
            for name, more in SERVICES.items():
                if mode == "snapshot" and name == "profiler":
                    continue
                rec = start_once(name, {**env, **more}, root / f"{name}.log", args.timeout)
                rows.append((name, mode, rec))
                print(name, mode, {k: rec.get(k) for k in ("wall_s", "elapsed_s", "replayed", "error")})
        await bus.close()
    lines = [
        "# Service start-up: snapshot + tail vs full replay",
        "",
        f"Produced by `python -m benchmarks.bench_startup --events {args.events} --tail {args.tail}` on "
        f"{_machine()}.",
        "",
        f"Log: {args.events:,} events (filled in {fill_s:.0f} s), cluster snapshot at sequence "
        f"{snap_seq:,} ({args.tail:,} events before the end). Each service is started alone with "
        "`shoal run <service>`; *wall* is spawn to its `projection_ready` log line (includes the "
        "Python start), *projection* is the projection's own time (snapshot load and check + tail).",
        "Digest: whether the state at ready equals a full fold of the log up to the same sequence "
        "(services that append on start, e.g. a node daemon registering, move the tail).",
        "",
        "| service | start | wall s | projection s | replayed | digest = full fold |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, mode, rec in rows:
        if rec.get("wall_s") is None:
            lines.append(f"| {name} | {mode} | failed | | | {rec.get('error', '')[:80]!r} |")
            continue
        same = "yes" if rec["digest"] == reference else f"(at seq {rec['last_seq']})"
        lines.append(
            f"| {name} | {mode} | {rec['wall_s']:.2f} | {rec['elapsed_s']:.2f} | {rec['replayed']:,} | {same} |"
        )
    lines += [
        "",
        "The profiler keeps measurements (its ProfileBook) that a cluster-state snapshot does not "
        "hold, so it still replays the whole log; it has no snapshot of its own yet.",
    ]
    out = Path(__file__).parent / "reports" / "startup.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=300_000)
    p.add_argument("--tail", type=int, default=1_000)
    p.add_argument("--timeout", type=float, default=300.0)
    asyncio.run(main(p.parse_args()))

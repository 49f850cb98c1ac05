"""Read latency: ``shoal jobs`` through admission's view vs a full replay of the log.

Fills a fresh authenticated embedded server's log with ``--events`` realistic events
(:func:`bench_services.history_chunks`: 64 nodes, 1,000 active jobs, completions,
progress reports, a share decision and its placement every 100 events), starts
``shoal run admission`` as its own identity (the shipped process; its start-up
replays the log once), then times, from one SDK client:

* ``--reads`` calls of ``Client.view("jobs")`` (what ``shoal jobs`` calls; it asks for
  at least the log's last sequence, so each read includes a stream-info round trip);
* ``--replays`` calls of ``Client.view("jobs", replay=True)`` (the old path: fold the
  whole log in the client).

Both answers must be equal. Writes ``benchmarks/reports/read_latency.md``.

    .venv/bin/python benchmarks/bench_reads.py                 # 10^6 events
    .venv/bin/python benchmarks/bench_reads.py --events 20000  # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal import queries
from shoal import state as st
from shoal.auth import CredentialStore
from shoal.bus import AuthFailed, Bus
from shoal.client import Client
from shoal.commands.run import CLI_ARGV

HERE = Path(__file__).resolve().parent
REPORT = HERE / "reports" / "read_latency.md"
PREFIX = "bench"


def _bench_services() -> Any:
    spec = importlib.util.spec_from_file_location("bench_services", HERE / "bench_services.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_services"] = module
    spec.loader.exec_module(module)
    return module


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    s = sorted(xs)
    return s[max(0, -(-int(q * len(s)) // 100) - 1)]


async def wait_admitted(url: str, creds: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            bus = await Bus.connect(url, "probe", creds=creds, declare=False)
        except AuthFailed:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        await bus.close()
        return


async def run(
    args: argparse.Namespace, url: str, admin: str, admission_creds: str, tmp: str
) -> dict[str, Any]:
    bench = _bench_services()
    out: dict[str, Any] = {"events": args.events}
    bus = await Bus.connect(url, prefix=PREFIX, creds=admin)
    try:
        t0 = time.perf_counter()
        for chunk in bench.history_chunks(args.events):
            await bus.publish_many(chunk, window=4096)
        out["fill_s"] = time.perf_counter() - t0
        out["last_seq"] = await bus.last_seq()
    finally:
        await bus.close()
    print(f"filled {out['last_seq']} events in {out['fill_s']:.1f} s", file=sys.stderr)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env.update(
        NATS_URL=url,
        NATS_CREDS=admission_creds,
        SHOAL_PREFIX=PREFIX,
        SHOAL_STATE_DIR=f"{tmp}/state",
        SHOAL_LOG_FORMAT="json",
    )
    log = open(f"{tmp}/admission.log", "wb")  # noqa: SIM115 (closed below)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*CLI_ARGV, "run", "admission"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with await Client.connect(url, PREFIX, creds=admin, timeout_s=10.0) as client:
            # Ready once a read is answered by the view (admission replayed the log).
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"admission exited {proc.returncode}; see {tmp}/admission.log")
                # The query alone: a read that falls back would replay the whole log.
                reply, _ = await client._query("nodes", queries.Query(wait_s=1.0))
                if reply is not None:
                    break
                await asyncio.sleep(0.5)
            out["admission_ready_s"] = time.perf_counter() - t0
            print(f"admission answers after {out['admission_ready_s']:.1f} s", file=sys.stderr)

            view_s: list[float] = []
            viewed = None
            for _ in range(args.reads):
                t0 = time.perf_counter()
                viewed = await client.view("jobs")
                view_s.append(time.perf_counter() - t0)
                assert client.last_read is not None and client.last_read.source == "view", client.last_read
            assert viewed is not None
            out["view_s"] = view_s
            out["view_seq"] = client.last_read.seq if client.last_read else 0
            out["jobs"] = len(viewed.jobs)
            out["answer_bytes"] = len(st.encode_state(viewed))

            replay_s: list[float] = []
            replayed = None
            for i in range(args.replays):
                t0 = time.perf_counter()
                replayed = await client.view("jobs", replay=True)
                replay_s.append(time.perf_counter() - t0)
                print(f"replay {i + 1}: {replay_s[-1]:.1f} s", file=sys.stderr)
            out["replay_s"] = replay_s
            if replayed is not None:
                out["equal"] = st.encode_state(replayed) == st.encode_state(viewed)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return out


def report(r: dict[str, Any], args: argparse.Namespace, wall_s: float) -> str:
    v = r["view_s"]
    ms = [x * 1000 for x in v]
    rep = r["replay_s"]
    p99 = pct(ms, 99)
    lines = [
        "# Read latency: `shoal jobs` through admission's view vs a replay",
        "",
        f"Written by `benchmarks/bench_reads.py --events {args.events} --reads {args.reads} "
        f"--replays {args.replays}` on {platform.node()} ({os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}); the whole run took {wall_s:.0f} s. The machine is shared with "
        "other work, so absolute numbers move between runs.",
        "",
        f"The log: {r['last_seq']:,} events from `bench_services.history_chunks` (64 nodes, 1,000 "
        "active jobs, one completing and one arriving every 1,000 events, progress reports, a "
        f"`SharesDecided` + `PlacementDecided` pair every 100 events), written in {r['fill_s']:.1f} s. "
        f"`shoal run admission` (as the admission identity) answered its first query "
        f"{r['admission_ready_s']:.1f} s after it was started (its start-up replays the log).",
        "",
        f'Each read is `Client.view("jobs")`, the call `shoal jobs` makes: a stream-info request '
        "for the log's last sequence, then the query, answered with every job "
        f"({r['jobs']:,} jobs, {r['answer_bytes']:,} bytes of msgpack, cut into parts of at most "
        "1 MiB) once admission's projection reached that sequence. The replay is "
        '`Client.view("jobs", replay=True)`: the old path, folding the whole log in the client.',
        "",
        "| path | reads | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
        f"| view | {len(v)} | {pct(ms, 50):.1f} ms | {pct(ms, 90):.1f} ms | {p99:.1f} ms | {max(ms):.1f} ms |",
    ]
    if rep:
        lines.append(
            f"| replay | {len(rep)} | {pct(rep, 50):.2f} s | {pct(rep, 90):.2f} s | "
            f"{pct(rep, 99):.2f} s | {max(rep):.2f} s |"
        )
    lines += [""]
    if rep:
        lines.append(
            f"Both paths gave the same jobs (encoded states equal: {r.get('equal')}). "
            f"Median speed-up: {pct(rep, 50) / (pct(v, 50)):.0f}x."
        )
        lines.append("")
    target = "met" if p99 < 100 else "**NOT met**"
    size = "10^6" if r["last_seq"] >= 1_000_000 else f"{r['last_seq']:,}"
    lines.append(
        f"Target: `shoal jobs` p99 under 100 ms with {size} events in the log: {target} ({p99:.1f} ms)."
    )
    if r["last_seq"] < 1_000_000:
        lines.append("")
        lines.append("This run used fewer than 10^6 events; the target is about 10^6.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the log (default 10^6)")
    parser.add_argument("--reads", type=int, default=200, help="reads through the view (default 200)")
    parser.add_argument("--replays", type=int, default=3, help="full replays (default 3; each is slow)")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args()
    from shoal.nats_server import EmbeddedNats

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-reads-") as tmp:
        server = EmbeddedNats(store_dir=f"{tmp}/js", creds_dir=f"{tmp}/creds", prefix="*")
        admin = server.admin_creds()
        admission_creds = str(CredentialStore(f"{tmp}/creds").ensure("admission"))
        with server:
            asyncio.run(wait_admitted(server.url, admission_creds))
            result = asyncio.run(run(args, server.url, admin, admission_creds, tmp))
    text = report(result, args, time.perf_counter() - started)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

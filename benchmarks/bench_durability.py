"""What each durability setting costs (issue 21): acknowledged publishes to shoal's event
stream on a single embedded nats-server with the default sync interval (2 min), with
``sync_interval: always`` (fsync before every ack), and on a local 3-node cluster with 3
replicas (default sync, and ``always``).

Run:  python benchmarks/bench_durability.py           (writes benchmarks/reports/durability.md)
      python benchmarks/bench_durability.py --quick

Two ways of publishing, both through :class:`shoal.bus.Bus` with the admin identity:
one event at a time (each waits for its ack: the latency a single admission command
sees) and ``Bus.publish_many`` (pipelined: the throughput of a burst). All stores are in
a temporary directory on this machine's disk; the three cluster nodes share the host
(and its disk), so the R3 figures include that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from shoal import codec
from shoal import events as ev
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats, LocalCluster

REPORT = Path(__file__).parent / "reports" / "durability.md"


def _events(n: int, tag: str) -> list[ev.Event]:
    return [ev.UserRegistered(user=f"u{tag}x{i}", tickets=1) for i in range(n)]


async def _wait_js(bus_url: str, creds: str) -> None:
    import nats

    nc = await nats.connect(servers=bus_url.split(","), nkeys_seed=creds)
    try:
        js = nc.jetstream(timeout=1.0)
        for _ in range(120):
            try:
                await js.account_info()
                return
            except Exception:
                await asyncio.sleep(0.25)
        raise RuntimeError("JetStream did not come up")
    finally:
        await nc.close()


async def _measure(url: str, creds: str, one_by_one: int, burst: int, runs: int) -> dict[str, float]:
    await _wait_js(url, creds)
    seq_lat: list[float] = []
    rates: list[float] = []
    replicas = 0
    for r in range(runs):
        bus = await Bus.connect(url, prefix=f"dur{os.getpid()}r{r}", creds=creds)
        try:
            replicas = bus.replicas
            await bus.publish_many([codec.wrap(e, at=time.time()) for e in _events(10, f"w{r}")])  # warm-up
            lat = []
            for e in _events(one_by_one, f"s{r}"):
                t = time.perf_counter()
                await bus.publish(codec.wrap(e, at=time.time()))
                lat.append(time.perf_counter() - t)
            seq_lat.extend(lat)
            items = [codec.wrap(e, at=time.time()) for e in _events(burst, f"b{r}")]
            t = time.perf_counter()
            await bus.publish_many(items)
            rates.append(burst / (time.perf_counter() - t))
        finally:
            await bus.close()
    seq_lat.sort()
    return {
        "replicas": replicas,
        "p50_ms": statistics.median(seq_lat) * 1e3,
        "p99_ms": seq_lat[int(len(seq_lat) * 0.99) - 1] * 1e3,
        "seq_per_s": len(seq_lat) / sum(seq_lat),
        "burst_per_s": statistics.median(rates),
    }


async def main_async(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    results: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="shoal-durability-") as tmp:
        store = CredentialStore(Path(tmp) / "creds")
        creds = str(store.ensure("admin"))
        cases: list[tuple[str, str | None, bool]] = [
            ("single server, default sync (2 min)", None, False),
            ("single server, sync_interval: always", "always", False),
            ("3-node cluster, R3, default sync", None, True),
            ("3-node cluster, R3, sync_interval: always", "always", True),
        ]
        for i, (label, sync, clustered) in enumerate(cases):
            base = Path(tmp) / f"case{i}"
            if clustered:
                with LocalCluster(base, creds_dir=store.directory, sync_interval=sync) as cluster:
                    res = await _measure(cluster.url, creds, args.one_by_one, args.burst, args.runs)
            else:
                with EmbeddedNats(base, creds_dir=store.directory, sync_interval=sync) as server:
                    res = await _measure(server.url, creds, args.one_by_one, args.burst, args.runs)
            print(f"{label}: {res}", flush=True)
            results.append((label, res))
    return results


def write_report(results: list[tuple[str, dict[str, float]]], args: argparse.Namespace) -> None:
    lines = [
        "# Durability settings and what they cost",
        "",
        f"Produced by `python benchmarks/bench_durability.py{' --quick' if args.quick else ''}` "
        f"on {platform.platform()} ({os.cpu_count()} CPUs); stores on this machine's disk; "
        "the cluster's three nodes share this host.",
        "",
        f"Acknowledged publishes through `shoal.bus.Bus`: {args.one_by_one} one at a time "
        f"(each waits for its ack) and a burst of {args.burst} with `publish_many`, "
        f"{args.runs} run(s) per setting.",
        "",
        "| setting | replicas | one at a time p50 (ms) | p99 (ms) | one at a time (events/s) "
        "| burst (events/s) |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results:
        lines.append(
            f"| {label} | {int(r['replicas'])} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {r['seq_per_s']:,.0f} | {r['burst_per_s']:,.0f} |"
        )
    lines += [
        "",
        "What each setting keeps (see docs/operations.md): with the default sync an "
        "acknowledged event is in the server's memory and page cache, written to disk "
        "within 2 minutes: a crash of the process loses nothing, a power loss of the "
        "host can lose up to the last 2 minutes. `always` fsyncs before each ack. R3 acks "
        "once a majority (2 of 3) of the servers holds the event, so one server can be "
        "lost outright; a power loss of all of them at once is again bounded by their sync "
        "interval.",
        "",
    ]
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(lines))
    print(f"wrote {REPORT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events, one run")
    parser.add_argument("--one-by-one", type=int, default=None)
    parser.add_argument("--burst", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    args = parser.parse_args()
    args.one_by_one = args.one_by_one or (300 if args.quick else 2000)
    args.burst = args.burst or (2000 if args.quick else 20000)
    args.runs = args.runs or (1 if args.quick else 3)
    results = asyncio.run(main_async(args))
    write_report(results, args)


if __name__ == "__main__":
    main()

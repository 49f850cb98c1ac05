"""Foundation benchmark (issue 2): the bus against plain nats-py on the same server.

Run:  python benchmarks/bench_bus.py            (full: 1,000,000-event replay, 3 runs)
      python benchmarks/bench_bus.py --quick    (100,000 events, 1 run)

Every figure of the bus is measured next to the raw ceiling in the same run, on
the same embedded nats-server (file storage) and with the same payloads, and the
report gives the ratio. Medians over ``--runs``.

Measured:
* publish: raw ``js.publish`` one at a time, raw gathered in batches of 100, raw
  ``publish_async``, raw pipelined core publishes with acks collected on a reply
  inbox (the ceiling), and ``Bus.publish_many`` (pipelined, every ack checked);
  all send the same ``Nats-Msg-Id`` header.
* replay: raw ``pull_subscribe().fetch``, raw ordered push consumer, raw pull on
  ``$JS.API.CONSUMER.MSG.NEXT`` — each fetching and decoding the envelope — against
  ``fold_log`` (fetch, decode *and* fold into the cluster state).
* cold start: load the newest snapshot, decode it, fold the tail (1,000 events),
  at two log lengths, to show it does not grow with the log.
* fold alone: events/s of ``shoal.state.fold`` over in-memory envelopes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import nats
from nats.js import api
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, fold_log
from shoal.events import Envelope
from shoal.nats_server import EmbeddedNats, find_nats_server

REPORT = Path(__file__).parent / "reports" / "foundation.md"
DEC = msgspec.msgpack.Decoder(Envelope)


def make_history(n: int, jobs: int = 1000, gpus: int = 64) -> list[Envelope]:
    """A realistic mix: submissions, then progress reports with a share decision every 100 events."""
    out: list[Envelope] = []
    t = 1_700_000_000.0
    for i in range(min(jobs, n)):
        spec = ev.JobSpec(user=f"u{i % 10}", model="resnet50", max_gpus=8, total_iterations=100_000)
        out.append(codec.wrap(ev.JobSubmitted(job_id=f"job-{i:06d}", spec=spec), at=t))
    epoch = 0
    i = 0
    while len(out) < n:
        t += 0.01
        if i % 100 == 99:
            epoch += 1
            start = (epoch * 7) % jobs
            shares = {f"job-{(start + k) % jobs:06d}": 1 for k in range(gpus)}
            out.append(codec.wrap(ev.SharesDecided(epoch=epoch, shares=shares, policy="afs-p"), at=t))
        else:
            out.append(
                codec.wrap(
                    ev.ProgressReported(
                        job_id=f"job-{i % jobs:06d}",
                        iteration=i,
                        loss=2.0 / (1 + i * 1e-4),
                        samples_per_s=1234.5,
                        num_gpus=4,
                        gpu_type="V100",
                        step_time_s=0.25,
                        epoch=epoch,
                    ),
                    at=t,
                )
            )
        i += 1
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


async def timed(fn: Callable[[], Awaitable[int]]) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = await fn()
    return n, time.perf_counter() - t0


# -- publish --------------------------------------------------------------------------


async def publish_benchmarks(url: str, n: int, runs: int) -> dict[str, float]:
    payloads = make_history(n)
    rates: dict[str, list[float]] = {}
    for run in range(runs):
        for k, (name, fn) in enumerate(PUBLISHERS.items()):
            prefix = f"pub{run}x{k}"
            bus = await Bus.connect(url, prefix=prefix)
            try:
                count = n if name != "raw js.publish (awaited)" else min(n, 20_000)
                envs = [codec.wrap(e.event) for e in payloads[:count]]  # fresh ids: nothing deduplicated
                _, secs = await timed(lambda fn=fn, bus=bus, envs=envs: fn(bus, envs))
                assert await bus.last_seq() == count, f"{name}: lost events"
                rates.setdefault(name, []).append(count / secs)
            finally:
                await bus.js.delete_stream(bus.names.events_stream)
                await bus.close()
    return {k: median(v) for k, v in rates.items()}


def _raw_items(bus: Bus, envs: list[Envelope]) -> list[tuple[str, bytes, dict[str, str]]]:
    return [(bus.names.subject(e.event), codec.encode(e), {"Nats-Msg-Id": e.id}) for e in envs]


async def raw_sequential(bus: Bus, envs: list[Envelope]) -> int:
    for subject, data, hdr in _raw_items(bus, envs):
        await bus.js.publish(subject, data, headers=hdr)
    return len(envs)


async def raw_gather100(bus: Bus, envs: list[Envelope]) -> int:
    items = _raw_items(bus, envs)
    for i in range(0, len(items), 100):
        await asyncio.gather(*(bus.js.publish(s, d, headers=h) for s, d, h in items[i : i + 100]))
    return len(envs)


async def raw_publish_async(bus: Bus, envs: list[Envelope]) -> int:
    items = _raw_items(bus, envs)
    futs = [await bus.js.publish_async(s, d, headers=h) for s, d, h in items]
    await bus.js.publish_async_completed()
    for f in futs:
        f.result()
    return len(envs)


async def raw_pipelined(bus: Bus, envs: list[Envelope]) -> int:
    """The ceiling: core publishes with a reply subject each, acks counted on one inbox."""
    items = _raw_items(bus, envs)
    nc = bus.nc
    inbox = nc.new_inbox()
    window = 4096
    done = asyncio.Event()
    got = 0
    target = 0
    errors = 0

    async def on_ack(msg: nats.aio.msg.Msg) -> None:
        nonlocal got, errors
        got += 1
        if b'"error"' in msg.data:
            errors += 1
        if got >= target:
            done.set()

    sub = await nc.subscribe(inbox + ".*", cb=on_ack)
    for start in range(0, len(items), window):
        chunk = items[start : start + window]
        target = start + len(chunk)
        done.clear()
        for k, (s, d, h) in enumerate(chunk):
            await nc.publish(s, d, reply=f"{inbox}.{start + k}", headers=h)
        await asyncio.wait_for(done.wait(), 30)
    await sub.unsubscribe()
    assert errors == 0
    return len(envs)


async def bus_publish_many(bus: Bus, envs: list[Envelope]) -> int:
    results = await bus.publish_many(envs, window=4096)
    return len(results)


PUBLISHERS: dict[str, Callable[[Bus, list[Envelope]], Awaitable[int]]] = {
    "raw js.publish (awaited)": raw_sequential,
    "raw js.publish (gather 100)": raw_gather100,
    "raw publish_async": raw_publish_async,
    "raw pipelined + reply inbox (ceiling)": raw_pipelined,
    "Bus.publish_many": bus_publish_many,
}


# -- replay ---------------------------------------------------------------------------


async def raw_fetch(bus: Bus, n: int) -> int:
    psub = await bus.js.pull_subscribe(
        f"{bus.names.prefix}.>",
        stream=bus.names.events_stream,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, mem_storage=True),
    )
    count = 0
    while count < n:
        for msg in await psub.fetch(1000, timeout=5):
            DEC.decode(msg.data)
            count += 1
    await psub.unsubscribe()
    return count


async def raw_ordered(bus: Bus, n: int) -> int:
    done = asyncio.Event()
    count = 0

    async def cb(msg: nats.aio.msg.Msg) -> None:
        nonlocal count
        DEC.decode(msg.data)
        count += 1
        if count >= n:
            done.set()

    sub = await bus.js.subscribe(
        f"{bus.names.prefix}.>", stream=bus.names.events_stream, cb=cb, ordered_consumer=True
    )
    await asyncio.wait_for(done.wait(), 600)
    await sub.unsubscribe()
    return count


async def raw_msg_next(bus: Bus, n: int, batch: int = 8192) -> int:
    info = await bus.js.add_consumer(
        bus.names.events_stream, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, mem_storage=True)
    )
    inbox = bus.nc.new_inbox()
    q: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()
    count = 0
    done = asyncio.Event()

    async def cb(msg: nats.aio.msg.Msg) -> None:
        nonlocal count
        if msg.reply:
            DEC.decode(msg.data)
            count += 1
        if count >= n or not msg.reply or count % batch == 0:
            done.set()

    sub = await bus.nc.subscribe(inbox, cb=cb, pending_msgs_limit=4 * batch)
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{bus.names.events_stream}.{info.name}"
    while count < n:
        done.clear()
        await bus.nc.publish(subject, b'{"batch":%d,"no_wait":true}' % batch, reply=inbox)
        await asyncio.wait_for(done.wait(), 30)
    del q
    await sub.unsubscribe()
    await bus.js.delete_consumer(bus.names.events_stream, info.name)
    return count


async def bus_fold(bus: Bus, n: int) -> int:
    state, last = await fold_log(bus, st.ClusterState(), st.apply)
    assert last == n and len(state.jobs) == 1000
    return last


REPLAYERS: dict[str, Callable[[Bus, int], Awaitable[int]]] = {
    "raw pull_subscribe().fetch + decode": raw_fetch,
    "raw ordered consumer + decode": raw_ordered,
    "raw $JS.API.CONSUMER.MSG.NEXT + decode": raw_msg_next,
    "Bus replay: fetch + decode + fold (fold_log)": bus_fold,
}


async def replay_benchmarks(bus: Bus, n: int, runs: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {}
    for _ in range(runs):
        for name, fn in REPLAYERS.items():
            count, secs = await timed(lambda fn=fn: fn(bus, n))
            assert count >= n, f"{name} read {count} of {n}"
            rates.setdefault(name, []).append(n / secs)
    return {k: median(v) for k, v in rates.items()}


async def cold_start(bus: Bus, tail: int = 1000) -> tuple[float, int]:
    """Seconds to load the snapshot and fold the last ``tail`` events; and the snapshot's size."""
    last = await bus.last_seq()
    snap_seq = last - tail
    state, _got = await fold_log(bus, st.ClusterState(), st.apply, start_seq=1)
    # Build the snapshot as of ``snap_seq`` (fold the prefix only).
    prefix_state = st.ClusterState()
    async for batch in bus.replay_batches(start_seq=1):
        for seq, env in batch:
            if seq > snap_seq:
                break
            st.apply(prefix_state, env)
        if batch.last_seq >= snap_seq:
            break
    await bus.save_snapshot("bench", snap_seq, st.encode_state(prefix_state), digest=st.digest(prefix_state))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        snap = await bus.load_snapshot("bench")
        assert snap is not None
        restored = st.decode_state(snap.state)
        restored, end = await fold_log(bus, restored, st.apply, start_seq=snap.seq + 1)
        times.append(time.perf_counter() - t0)
        assert end == last and st.digest(restored) == st.digest(state), "cold start diverged from full replay"
    return median(times), len(snap.state)


def fold_alone(history: list[Envelope], runs: int) -> float:
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        st.fold(history)
        rates.append(len(history) / (time.perf_counter() - t0))
    return median(rates)


async def fill(bus: Bus, history: list[Envelope]) -> None:
    for i in range(0, len(history), 50_000):
        await bus.publish_many(history[i : i + 50_000], window=4096)


async def main_async(args: argparse.Namespace) -> str:
    n_replay = 100_000 if args.quick else args.events
    n_pub = 20_000 if args.quick else args.publish_events
    runs = 1 if args.quick else args.runs
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp, EmbeddedNats(store_dir=tmp) as server:
        history = make_history(n_replay)
        size = statistics.mean(len(codec.encode(e)) for e in history[1000:2000])
        print(f"publish: {n_pub} events x {runs} runs …", file=sys.stderr)
        pub = await publish_benchmarks(server.url, n_pub, runs)
        print(f"filling a file-backed stream with {n_replay} events …", file=sys.stderr)
        bus = await Bus.connect(server.url, prefix="replay")
        await fill(bus, history)
        print("replay …", file=sys.stderr)
        rep = await replay_benchmarks(bus, n_replay, runs)
        print("cold start …", file=sys.stderr)
        cold_big, snap_bytes = await cold_start(bus)
        small_n = max(10_000, n_replay // 10)
        small = await Bus.connect(server.url, prefix="replaysmall")
        await fill(small, history[:small_n])
        cold_small, _ = await cold_start(small)
        await small.close()
        await bus.close()
    print("fold alone …", file=sys.stderr)
    fold_rate = fold_alone(history, runs)

    ceiling_pub = pub["raw pipelined + reply inbox (ceiling)"]
    bus_pub = pub["Bus.publish_many"]
    raw_replay = {k: v for k, v in rep.items() if k.startswith("raw")}
    best_raw_name = max(raw_replay, key=raw_replay.__getitem__)
    bus_replay = rep["Bus replay: fetch + decode + fold (fold_log)"]
    nats_version = subprocess.run(
        [find_nats_server(), "--version"], capture_output=True, text=True
    ).stdout.strip()
    cmd = "python benchmarks/bench_bus.py" + (" --quick" if args.quick else "")

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    lines = [
        "# Foundation benchmark: bus, replay, cold start, fold",
        "",
        f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d')}.",
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}, {nats_version}, "
        f"nats-py {importlib.metadata.version('nats-py')}, file-backed JetStream on an embedded server, loopback.",
        f"Events: msgspec/msgpack envelopes, mean {size:.0f} bytes (progress reports, with a share decision every "
        f"100 events and 1,000 submitted jobs). Medians of {runs} run(s).",
        "",
        f"## Publish ({n_pub:,} events per run)",
        "",
        "| path | events/s | vs ceiling |",
        "|---|---:|---:|",
    ]
    for name, rate in pub.items():
        lines.append(f"| {name} | {rate:,.0f} | {rate / ceiling_pub:.0%} |")
    lines += [
        "",
        f"Target: the bus at ≥ 70% of the raw pipelined ceiling — measured {bus_pub / ceiling_pub:.0%}: "
        f"{verdict(bus_pub >= 0.7 * ceiling_pub)}. The bus also encodes each envelope, injects trace "
        "context and checks every ack for an error.",
        "",
        f"## Replay ({n_replay:,} events from a file-backed stream)",
        "",
        "| path | events/s | vs fastest raw |",
        "|---|---:|---:|",
    ]
    for name, rate in rep.items():
        lines.append(f"| {name} | {rate:,.0f} | {rate / raw_replay[best_raw_name]:.0%} |")
    lines += [
        "",
        f"Target: decode **and fold** at ≥ 60% of the fastest raw fetch-and-decode path ({best_raw_name}) — "
        f"measured {bus_replay / raw_replay[best_raw_name]:.0%}: "
        f"{verdict(bus_replay >= 0.6 * raw_replay[best_raw_name])}. Absolute: {bus_replay:,.0f} events/s.",
        "",
        "## Cold start from a snapshot plus a 1,000-event tail",
        "",
        "| log length | seconds |",
        "|---:|---:|",
        f"| {small_n:,} | {cold_small:.3f} |",
        f"| {n_replay:,} | {cold_big:.3f} |",
        "",
        f"Snapshot size {snap_bytes:,} bytes (1,000 jobs). Target: under 1 s at 1,000,000 events and independent "
        f"of log length — {verdict(cold_big < 1.0)} at {n_replay:,} events; ratio long/short log "
        f"{cold_big / cold_small:.2f}. Each cold start is checked to reach the same digest as a full replay.",
        "",
        "## Fold alone (one core)",
        "",
        f"{fold_rate:,.0f} events/s over {len(history):,} in-memory envelopes. Target ≥ 300,000/s: "
        f"{verdict(fold_rate >= 300_000)}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the replayed log")
    parser.add_argument("--publish-events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100k events, one run")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``shoal demo``: the whole system on a short slice of a real trace, in about a minute.

What it does: starts an embedded nats-server with a temporary store (or uses
``NATS_URL``, under a fresh prefix whose streams are deleted afterwards, so a demo
never touches a real installation's log), runs the emulated stack
(:class:`shoal_services.stack.EmulatedStack`: admission, allocator, placer and node
daemons as tasks of this process, one real sidecar subprocess per job and node),
replays the first ``--jobs`` jobs of a Microsoft Philly VC at their trace arrival
times through the admission service, shows a live progress line, and prints the
result computed from the event log: JCT (average, median, p99), makespan, GPU
utilisation and reconfigurations. Then it stops everything and exits 0.

Choices:

* The slice is the first ``--jobs`` jobs of ``--vc`` (default ``0e4a51``, 40 jobs:
  one-GPU requests of 1 minute to 20 hours, arriving over 63 hours, which elastic
  policies may grow up to their model's maximum). Arrival times and durations are the
  trace's; the only compression is the clock: ``--time-scale`` virtual seconds per
  wall second, by default chosen so that the slice's critical path (latest arrival +
  run time on the requested GPUs) takes ``--target-s`` wall seconds.
* The policy defaults to ``afs-p``; if this build lacks it, the first available of a
  few well-known policies is used and the substitution is announced. An explicitly
  requested policy that cannot be loaded is an error.
* Service logs go to ``demo.log`` in a temporary directory (its path is printed), so
  the terminal shows the live view; errors still reach stderr.
* Ctrl-C stops the replay, prints what finished so far and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from shoal.cli import CommandError
from shoal.commands.run import add_settings_args, load_settings, settings_overrides

DEFAULT_POLICY = "afs-p"
FALLBACK_POLICIES = ("afs-p", "afs-l", "srtf", "tiresias-l", "fifo", "max-min", "gandiva-fair")
DEFAULT_VC = "0e4a51"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="replay a short real Philly slice on an emulated cluster and print JCT and utilisation",
        description=(
            "Start an embedded NATS server and the emulated stack, replay the first jobs of a "
            "Microsoft Philly VC at high time scale with a live view, then print JCT and utilisation."
        ),
    )
    p.add_argument(
        "--jobs", type=int, default=40, metavar="N", help="jobs from the start of the VC (default 40)"
    )
    p.add_argument("--vc", default=DEFAULT_VC, help=f"Philly VC (default {DEFAULT_VC})")
    p.add_argument("--nodes", type=int, default=4, metavar="N", help="emulated nodes (default 4)")
    p.add_argument("--gpus-per-node", type=int, default=4, metavar="G", help="GPUs per node (default 4)")
    p.add_argument("--gpu-type", default="V100", help="GPU generation (default V100)")
    p.add_argument(
        "--target-s",
        type=float,
        default=75.0,
        metavar="S",
        help="wall seconds the default time scale aims at (default 75)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the trace's model assignment (default 0)")
    p.add_argument("--tick", type=float, default=1.0, metavar="S", help="wall seconds between progress lines")
    add_settings_args(p)
    p.add_argument("--in-session", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=demo)


def choose_policy(requested: str | None) -> tuple[str, Any, str | None]:
    """(name, policy, note): the requested policy, or the default with a fallback.

    Raises:
        CommandError: an explicitly requested policy cannot be loaded.
    """
    try:
        from shoal.policies.registry import get_policy
    except Exception as exc:
        raise CommandError(f"the policy registry cannot be imported: {exc!r}") from None
    if requested:
        try:
            return requested, get_policy(requested), None
        except (ValueError, TypeError, ImportError) as exc:
            raise CommandError(f"policy {requested!r}: {exc}") from None
    first_error = ""
    for name in FALLBACK_POLICIES:
        try:
            policy = get_policy(name)
        except (ValueError, TypeError, ImportError) as exc:
            first_error = first_error or f"{name}: {exc}"
            continue
        note = (
            None
            if name == DEFAULT_POLICY
            else f"{DEFAULT_POLICY} is not available in this build; using {name}"
        )
        return name, policy, note
    raise CommandError(f"no allocation policy can be loaded ({first_error})")


def critical_path_s(jobs: Sequence[Any]) -> float:
    """Latest (arrival + run time on the requested GPUs), from the first arrival."""
    t0 = min(j.submit_time_s for j in jobs)
    return max(j.submit_time_s - t0 + j.duration_s for j in jobs)


def auto_time_scale(jobs: Sequence[Any], target_s: float) -> float:
    """A round time scale that fits the slice's critical path into ``target_s`` wall seconds."""
    raw = max(1.0, critical_path_s(jobs) / max(1.0, target_s))
    exp = 10 ** math.floor(math.log10(raw))
    for step in (1, 2, 2.5, 5, 10):
        if raw <= step * exp:
            return float(step * exp)
    return raw


def _hours(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds / 3600:.2f} h"


class LiveView:
    """The progress line: virtual time, jobs done/running/queued, GPU use, shares."""

    def __init__(self, out: TextIO, job_ids: Sequence[str], total_gpus: int, interactive: bool) -> None:
        self.out = out
        self.index = {j: i for i, j in enumerate(job_ids)}
        self.total_gpus = total_gpus
        self.interactive = interactive
        self.lines = 0

    def line(self, state: Any, virtual_s: float) -> str:
        from shoal.state import COMPLETED, FINISHED_STATUSES

        jobs = [state.jobs[j] for j in self.index if j in state.jobs]
        done = sum(1 for j in jobs if j.status == COMPLETED)
        failed = sum(1 for j in jobs if j.status in FINISHED_STATUSES and j.status != COMPLETED)
        placed = {j: n for j, n in state.placed.items() if j in self.index and n > 0}
        running = len(placed)
        queued = sum(1 for j in jobs if j.status not in FINISHED_STATUSES) - running
        used = sum(placed.values())
        util = used / self.total_gpus if self.total_gpus else 0.0
        shares = " ".join(
            f"j{self.index[j]:02d}:{n}" for j, n in sorted(placed.items(), key=lambda kv: self.index[kv[0]])
        )
        if len(shares) > 60:
            shares = shares[:57].rsplit(" ", 1)[0] + " …"
        text = (
            f"t={max(0.0, virtual_s) / 3600:6.2f}h  done {done:>3}/{len(self.index)}  running {running:>3}  "
            f"queued {max(0, queued):>3}  GPUs {used:>3}/{self.total_gpus} ({util:4.0%})"
        )
        if failed:
            text += f"  failed {failed}"
        return f"{text}  [{shares}]" if shares else text

    def __call__(self, state: Any, virtual_s: float) -> None:
        text = self.line(state, virtual_s)
        if self.interactive:
            self.out.write("\r\x1b[K" + text)
        else:
            self.out.write(text + "\n")
        self.out.flush()
        self.lines += 1

    def finish(self) -> None:
        if self.interactive and self.lines:
            self.out.write("\n")
            self.out.flush()


def result_table(result: dict[str, float], wall_s: float, policy: str) -> str:
    rows = [
        ("policy", policy),
        ("jobs completed", f"{int(result['completed'])}/{int(result['jobs'])}"),
        ("average JCT", _hours(result["avg_jct_s"])),
        ("median JCT", _hours(result["median_jct_s"])),
        ("p99 JCT", _hours(result["p99_jct_s"])),
        ("makespan", _hours(result["makespan_s"])),
        (
            "GPU utilisation",
            "-" if math.isnan(result["gpu_utilisation"]) else f"{result['gpu_utilisation']:.1%}",
        ),
        ("reconfigurations", f"{int(result['reconfigurations'])}"),
        ("wall time", f"{wall_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def demo(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise CommandError(f"--jobs must be >= 1, got {args.jobs}")
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise CommandError("--nodes and --gpus-per-node must be >= 1")
    if args.target_s <= 0 or args.tick <= 0:
        raise CommandError("--target-s and --tick must be positive")
    from shoal.workloads import load_philly

    try:
        jobs = load_philly(args.vc, seed=args.seed, limit=args.jobs)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if len(jobs) < args.jobs and not args.in_session:
        print(f"VC {args.vc} has only {len(jobs)} jobs in the trace; replaying all of them", flush=True)
    time_scale = args.time_scale or auto_time_scale(jobs, args.target_s)
    overrides = settings_overrides(args)
    overrides["time_scale"] = time_scale
    overrides["log_level"] = args.log_level or "info"
    settings = load_settings(**overrides)
    # The policy flag, else SHOAL_POLICY when set, else the default (with a fallback).
    name, policy, note = choose_policy(args.policy or os.environ.get("SHOAL_POLICY") or None)
    if settings.policy_params:
        from shoal.policies.registry import get_policy

        try:
            policy = get_policy(name, **settings.policy_params)
        except (ValueError, TypeError, ImportError) as exc:
            raise CommandError(f"policy {name!r}: {exc}") from None
    if not args.in_session:
        # The demo runs in a session of its own so that Ctrl-C reaches only us; we pass
        # it on as SIGTERM (see shoal.runtime.run_in_session).
        if note:
            print(note, flush=True)
        from shoal.commands.run import CLI_ARGV
        from shoal.runtime import run_in_session

        argv = [*CLI_ARGV, "demo", "--in-session", "--policy", name, "--time-scale", repr(time_scale)]
        argv += [
            "--jobs",
            str(args.jobs),
            "--vc",
            args.vc,
            "--seed",
            str(args.seed),
            "--tick",
            repr(args.tick),
        ]
        argv += [
            "--nodes",
            str(args.nodes),
            "--gpus-per-node",
            str(args.gpus_per_node),
            "--gpu-type",
            args.gpu_type,
        ]
        return run_in_session(argv, settings)
    workdir = Path(tempfile.mkdtemp(prefix="shoal-demo-"))
    # Our own output goes to a copy of stdout; fd 1 (inherited by every sidecar) and the
    # service logs go to demo.log, so the terminal shows only the live view.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    interactive = out.isatty()
    log_path = workdir / "demo.log"
    log_file = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives until the end of the demo
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(log_file.fileno(), 1)
    from shoal.log import configure_logging

    configure_logging(settings, stream=log_file)
    try:
        print(
            f"shoal demo: {len(jobs)} jobs of Philly VC {args.vc} on {args.nodes}×{args.gpus_per_node} "
            f"{args.gpu_type}, policy {name}, time scale {time_scale:g}× "
            f"(critical path {critical_path_s(jobs) / 3600:.1f} h ≈ {critical_path_s(jobs) / time_scale:.0f} s)",
            file=out,
        )
        print(f"logs: {log_path}", file=out)
        code = asyncio.run(_demo(args, settings, jobs, name, policy, out, interactive))
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        log_file.close()
        out.close()
    return code


async def _demo(
    args: argparse.Namespace,
    settings: Any,
    jobs: Sequence[Any],
    policy_name: str,
    policy: Any,
    out: TextIO,
    interactive: bool,
) -> int:
    from shoal_services.stack import EmulatedStack, StackConfig, replay_trace, summarize

    from shoal.bus import Bus, NoServerError
    from shoal.nats_server import EmbeddedNats, NatsServerError

    server: EmbeddedNats | None = None
    external = bool(settings.nats_url)
    if external:
        url = settings.nats_url
        prefix = f"{settings.prefix}-demo-{os.getpid()}-{int(time.time())}"
    else:
        server = EmbeddedNats()  # a temporary store, removed when the server stops
        try:
            server.start()
        except NatsServerError as exc:
            raise CommandError(str(exc)) from None
        url, prefix = server.url, settings.prefix
    print(f"NATS: {url}  prefix: {prefix}", file=out, flush=True)
    try:
        try:
            bus = await Bus.connect(url, prefix=prefix, name="shoal-demo")
        except NoServerError as exc:
            raise CommandError(f"{exc} (check NATS_URL)") from None
        config = StackConfig(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_type=args.gpu_type,
            time_scale=settings.time_scale,
            costs=settings.costs,
            catalog=settings.catalog or "",
            placer=settings.placer,
            network_packing=settings.network_packing,
        )
        stack = EmulatedStack(bus, url, policy, config)
        total_gpus = args.nodes * args.gpus_per_node
        ids = [j.job_id for j in jobs]
        view = LiveView(out, ids, total_gpus, interactive)
        interrupted = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupted.set)
        started = time.monotonic()
        try:
            await stack.start()
            replay = asyncio.create_task(replay_trace(stack, jobs, on_tick=view, tick_s=args.tick))
            stopper = asyncio.create_task(interrupted.wait())
            await asyncio.wait({replay, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not replay.done():
                replay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await replay
            elif replay.exception() is not None:
                view.finish()
                raise replay.exception()  # type: ignore[misc]
            view(stack.projection.state, stack.clock.now() - stack.clock.origin)
            view.finish()
            wall = time.monotonic() - started
            result = summarize(stack.projection.state, ids, total_gpus)
        finally:
            await stack.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if external:
                await _delete_installation(bus)
            await bus.close()
        if interrupted.is_set():
            print("interrupted; results so far:", file=out)
        print(f"results ({policy_name}, from the event log):", file=out)
        print(result_table(result, wall, policy_name), file=out, flush=True)
        return 130 if interrupted.is_set() else 0
    finally:
        if server is not None:
            server.stop()


async def _delete_installation(bus: Any) -> None:
    """Remove the demo's streams and buckets from an external server (best effort)."""
    n = bus.names
    for stream in (n.events_stream, n.ctl_stream, n.dlq_stream):
        with contextlib.suppress(Exception):
            await bus.js.delete_stream(stream)
    with contextlib.suppress(Exception):
        await bus.js.delete_object_store(n.snapshot_bucket)
    with contextlib.suppress(Exception):
        names = [s.config.name async for s in _streams(bus)]
        for name in names:
            if name.startswith(f"KV_{n.lease_bucket}"):
                await bus.js.delete_stream(name)


async def _streams(bus: Any) -> Any:
    for info in await bus.js.streams_info():
        yield info

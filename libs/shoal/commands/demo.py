"""``shoal demo``: the whole system on a short slice of a real trace, in about a minute.

What it does: starts the same supervised installation ``shoal up`` starts (see
:func:`shoal.commands.up.installation`), but on an embedded nats-server with a
temporary JetStream store and in a fresh state directory (with ``NATS_URL`` set: that
server, under a fresh prefix whose streams are deleted afterwards), so a demo never
touches a real installation: admission, profiler, allocator, placer and trader, each
its own process (``shoal run <service>``), and ``--nodes`` emulated node daemons,
which start one real sidecar process per job they run, all on one scaled clock
(``--time-scale`` with a shared ``SHOAL_CLOCK_ORIGIN``). Once the nodes are
registered and the leader-elected services hold their leases, it replays the first
``--jobs`` jobs of a Microsoft Philly VC at their trace arrival times through the
admission service with the SDK (each job's calibrated throughput curves travel in its
spec as a known profile, as the simulator has them) and shows a live view fed by the
event stream: ``shoal top``'s frame on a terminal, one progress line per ``--tick``
otherwise (so logs and CI stay readable). When every job has finished it stops the
children (each drains its work) and the server, prints the result computed from the
event log: JCT (average, median, p99), makespan, GPU utilisation, reconfigurations,
and how many decisions, profiler models and progress reports the services wrote;
then it exits 0.

Choices:

* The slice is the first ``--jobs`` jobs of ``--vc`` (default ``0e4a51``, 40 jobs:
  one-GPU requests of 1 minute to 20 hours, arriving over 63 hours, which elastic
  policies may grow up to their model's maximum). Arrival times and durations are the
  trace's; the only compression is the clock: ``--time-scale`` virtual seconds per
  wall second, by default chosen so that the slice's critical path (latest arrival +
  run time on the requested GPUs) takes ``--target-s`` wall seconds; starting and
  stopping the processes comes on top.
* An arrival is stamped by the admission service when the submission reaches it (an
  installation accepts no client-chosen arrival time), and every decision, placement
  and progress report crosses processes, so results differ somewhat from
  ``shoal simulate`` on the same slice: at a time scale of thousands each wall
  millisecond of latency is seconds of virtual time, and the profiler's models replace
  the calibrated curves as measurements come in.
* The policy defaults to ``afs-p``; if this build lacks it, the first available of a
  few well-known policies is used and the substitution is announced. An explicitly
  requested policy that cannot be loaded is an error.
* Every child's output and the demo's own log go to ``demo.log`` in a temporary
  directory (its path is printed; the file is kept), so the terminal shows only the
  live view and the results.
* Ctrl-C stops the replay and the services, prints what finished so far and exits
  130; a second Ctrl-C exits at once (the children die with the demo).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import os
import shutil
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
    if getattr(args, "state_dir", None) and not args.in_session:
        raise CommandError(
            "shoal demo always runs in a fresh temporary state directory, removed at the end "
            "(the log it prints the path of stays); --state-dir is for shoal up"
        )
    import msgspec

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
    overrides["gpu_type"] = args.gpu_type
    settings = load_settings(**overrides)
    # The policy flag, else SHOAL_POLICY when set, else the default (with a fallback).
    name, policy, note = choose_policy(args.policy or os.environ.get("SHOAL_POLICY") or None)
    settings = msgspec.structs.replace(settings, policy=name)
    if settings.policy_params:
        from shoal.policies.registry import get_policy

        try:
            policy = get_policy(name, **settings.policy_params)
        except (ValueError, TypeError, ImportError) as exc:
            raise CommandError(f"policy {name!r}: {exc}") from None
    if not args.in_session:
        from shoal.commands.up import _preflight

        _preflight(settings)  # catalog and placer: fail here, not in a crash-looping child
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
    state_dir = workdir / "state"
    # A fresh state dir (so no `shoal up` of the user's is seen or disturbed), one clock
    # origin for every process, and on an external server a prefix of our own.
    fresh: dict[str, Any] = {"state_dir": str(state_dir), "clock_origin": time.time()}
    if settings.nats_url:
        fresh["prefix"] = f"{settings.prefix}-demo-{os.getpid()}-{int(time.time())}"
    settings = msgspec.structs.replace(settings, **fresh)
    out = sys.stdout
    interactive = out.isatty()
    log_path = workdir / "demo.log"
    log_file = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives until the end of the demo
    from shoal.log import configure_logging

    configure_logging(settings, stream=log_file)
    try:
        print(
            f"shoal demo: {len(jobs)} jobs of Philly VC {args.vc} on {args.nodes}×{args.gpus_per_node} "
            f"{args.gpu_type}, policy {name}, time scale {time_scale:g}× "
            f"(critical path {critical_path_s(jobs) / 3600:.1f} h ≈ {critical_path_s(jobs) / time_scale:.0f} s)",
            file=out,
        )
        print(f"logs: {log_path}", file=out, flush=True)
        return asyncio.run(_demo(args, settings, jobs, name, policy, out, interactive, log_file.fileno()))
    finally:
        log_file.close()
        shutil.rmtree(state_dir, ignore_errors=True)


class _Stopped(Exception):
    """The demo was interrupted (Ctrl-C/SIGTERM) before the replay finished."""


async def _demo(
    args: argparse.Namespace,
    settings: Any,
    jobs: Sequence[Any],
    policy_name: str,
    policy: Any,
    out: TextIO,
    interactive: bool,
    log_fd: int,
) -> int:
    from shoal.bus import Bus, NoServerError
    from shoal.commands.top import TopModel
    from shoal.commands.up import installation

    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if interrupted.is_set():  # a second one: do not wait for the drain
            with contextlib.suppress(Exception):
                if interactive:
                    out.write(_LEAVE_SCREEN)
                out.flush()
            os._exit(130)
        interrupted.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    started = time.monotonic()
    model = TopModel()
    ids = [j.job_id for j in jobs]
    total_gpus = args.nodes * args.gpus_per_node
    counts: collections.Counter[str] = collections.Counter()
    restarts: dict[str, int] = {}
    wall = 0.0
    try:
        async with installation(
            settings,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_type=args.gpu_type,
            store_dir=None,
            stdout=log_fd,
            stderr=log_fd,
        ) as inst:
            names = [s.name for s in inst.specs]
            control = [n for n in names if not n.startswith("node-daemon-")]
            print(
                f"NATS: {inst.url}  prefix: {settings.prefix}\n"
                f"services: {', '.join(control)} and {len(names) - len(control)} node "
                f"daemon{'' if len(names) - len(control) == 1 else 's'}, each its own process",
                file=out,
                flush=True,
            )
            if inst.skipped:
                print(f"not in this build, skipped: {', '.join(inst.skipped)}", file=out, flush=True)
            try:
                bus = await Bus.connect(
                    inst.url, prefix=settings.prefix, name="shoal-demo", creds=inst.admin_creds
                )
            except NoServerError as exc:
                raise CommandError(f"{exc} (check NATS_URL)") from None
            try:
                run = _Replay(args, settings, jobs, policy, bus, inst, model, counts, out, interactive)
                await run.run(interrupted)
            finally:
                wall = time.monotonic() - started
                await bus.close()
                restarts = {n: c.restarts for n, c in inst.supervisor.children.items() if c.restarts}
            if not interrupted.is_set():
                print("stopping the services …", file=out, flush=True)
        unclean = inst.unclean_exits()
    finally:
        if settings.nats_url:  # the demo's prefix on someone else's server: removed afterwards
            await _delete_installation(settings)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    from shoal_services.stack import summarize

    result = summarize(model.state, ids, total_gpus)
    if interrupted.is_set():
        print("interrupted; results so far:", file=out)
    print(f"results ({policy_name}, from the event log):", file=out)
    print(result_table(result, wall, policy_name), file=out)
    print(
        f"  {sum(counts.values())} events: {counts['alloc.shares_decided']} share decisions, "
        f"{counts['profile.throughput_model_updated']} throughput models from the profiler, "
        f"{counts['job.progress']} progress reports",
        file=out,
        flush=True,
    )
    if restarts:
        print(f"note: services restarted after a crash (see the log): {restarts}", file=sys.stderr)
    if unclean:
        print(f"children that did not exit cleanly: {unclean}", file=sys.stderr, flush=True)
    return 130 if interrupted.is_set() else 0


_ENTER_SCREEN = "\x1b[?1049h\x1b[?25l"
_LEAVE_SCREEN = "\x1b[?25h\x1b[?1049l"


class _Replay:
    """Follow the log into ``model``, wait for the services, submit the trace, draw."""

    def __init__(
        self,
        args: argparse.Namespace,
        settings: Any,
        jobs: Sequence[Any],
        policy: Any,
        bus: Any,
        inst: Any,
        model: Any,
        counts: collections.Counter[str],
        out: TextIO,
        interactive: bool,
    ) -> None:
        from shoal.client import Client
        from shoal.clock import ScaledClock

        self.args = args
        self.settings = settings
        self.jobs = jobs
        self.policy = policy
        self.bus = bus
        self.client = Client(bus)
        self.inst = inst
        self.model = model
        self.counts = counts
        self.out = out
        self.interactive = interactive
        self.color = interactive and not os.environ.get("NO_COLOR")
        self.clock = ScaledClock(settings.time_scale, settings.clock_origin)
        self.ids = [j.job_id for j in jobs]
        self.view = LiveView(out, self.ids, args.nodes * args.gpus_per_node, interactive=False)
        self.origin = self.clock.now()

    async def _follow(self, stop: asyncio.Event) -> None:
        async for batch in self.bus.replay_batches(follow=True, stop=stop, idle_expires_s=0.25):
            for seq, env in batch:
                self.model.apply(seq, env)
                self.counts[env.type] += 1
            self.model.seq = max(self.model.seq, batch.last_seq)

    def _check_children(self) -> None:
        """Raise when a service crashed more often than the supervisor restarts it."""
        sup = self.inst.supervisor
        for name, child in sup.children.items():
            proc = child.proc
            if proc is not None and proc.returncode is not None and child.restarts >= sup.max_restarts:
                raise CommandError(
                    f"service {name} keeps crashing (exit status {proc.returncode}); see the log"
                )

    async def _ready(self, interrupted: asyncio.Event, timeout_s: float = 120.0) -> None:
        """Until every node is up and every leader-elected service holds its lease."""
        from shoal.state import NODE_UP

        names = {s.name for s in self.inst.specs}
        leases = [
            await self.bus.lease(n, "shoal-demo", ttl_s=self.settings.lease_ttl_s)
            for n in ("allocator", "placer", "profiler", "trader")
            if n in names
        ]
        deadline = time.monotonic() + timeout_s
        while not interrupted.is_set():
            self._check_children()
            up = sum(1 for n in self.model.state.nodes.values() if n.status == NODE_UP)
            if up >= self.args.nodes and all([await lease.holder_now() for lease in leases]):
                return
            if time.monotonic() > deadline:
                raise CommandError(f"the services did not come up within {timeout_s:.0f} s; see the log")
            await asyncio.sleep(0.1)

    def _origin(self) -> float:
        """The virtual instant of the trace's first arrival: now, rounded up to the
        allocator's periodic-decision grid (or to a whole second), so that periodic
        decisions fall on the trace's own grid, as in the simulator."""
        from shoal.allocation import policy_tick

        tick = policy_tick(self.policy) or 1.0
        base = self.settings.clock_origin
        return float(base + tick * math.ceil((self.clock.now() - base) / tick))

    async def _submit(self, job: Any, interrupted: asyncio.Event) -> None:
        from shoal_services.stack import with_profile

        from shoal import events as ev
        from shoal.client import NoAdmissionError

        cmd = ev.SubmitJob(spec=with_profile(job), job_id=job.job_id)
        for attempt in range(20):
            try:
                await self.client.command(cmd)
                return
            except NoAdmissionError:
                if attempt == 19 or interrupted.is_set():
                    raise
                await asyncio.sleep(0.25)

    def _draw(self) -> None:
        from shoal.commands.top import render

        state = self.model.state
        vnow = self.clock.now() - self.origin
        if not self.interactive:
            self.view(state, vnow)
            return
        size = shutil.get_terminal_size((120, 40))
        frame = render(
            self.model,
            prefix=self.settings.prefix,
            width=size.columns,
            height=max(10, size.lines - 2),
            color=self.color,
            finished=5,
        )
        head = "shoal demo · " + self.view.line(state, vnow)
        text = head[: size.columns] + "\n" + frame
        self.out.write("\x1b[H" + text.replace("\n", "\x1b[K\n") + "\x1b[K\x1b[J")
        self.out.flush()

    async def run(self, interrupted: asyncio.Event) -> None:
        from shoal.state import FINISHED_STATUSES

        stop = asyncio.Event()
        follower = asyncio.create_task(self._follow(stop))
        loop = asyncio.get_running_loop()
        if self.interactive:
            self.out.write(_ENTER_SCREEN)
        try:
            await self._ready(interrupted)
            pending = sorted(self.jobs, key=lambda j: (j.submit_time_s, j.job_id))
            t0 = pending[0].submit_time_s if pending else 0.0
            self.origin = self._origin()
            next_tick = loop.time()
            while not interrupted.is_set():
                if follower.done():
                    follower.result()  # its exception, if any
                    raise CommandError("the event stream ended unexpectedly")
                self._check_children()
                now = self.clock.now()
                due = []
                while pending and self.origin + pending[0].submit_time_s - t0 <= now:
                    due.append(pending.pop(0))
                # Everything due is submitted at once, so a same-instant burst lands together.
                await asyncio.gather(*(self._submit(job, interrupted) for job in due))
                state = self.model.state
                if loop.time() >= next_tick:
                    self._draw()
                    next_tick = loop.time() + self.args.tick
                if not pending and all(
                    j in state.jobs and state.jobs[j].status in FINISHED_STATUSES for j in self.ids
                ):
                    break
                wait = (
                    self.clock.to_wall(self.origin + pending[0].submit_time_s - t0 - now) if pending else 0.05
                )
                await asyncio.sleep(min(max(wait, 0.0), 0.05))
        finally:
            if self.interactive:
                self.out.write(_LEAVE_SCREEN)
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(follower, 2.0)
            if not follower.done():
                follower.cancel()
                with contextlib.suppress(BaseException):
                    await follower
            # The last state, as a plain line on the normal screen.
            self.view(self.model.state, self.clock.now() - self.origin)


async def _delete_installation(settings: Any) -> None:
    """Remove the demo's streams and buckets from an external server (best effort)."""
    from shoal.bus import Bus

    try:
        bus = await Bus.connect(
            settings.nats_url,
            prefix=settings.prefix,
            name="shoal-demo",
            declare=False,
            creds=settings.nats_creds,
        )
    except Exception:
        return
    try:
        n = bus.names
        for stream in (n.events_stream, n.ctl_stream, n.dlq_stream):
            with contextlib.suppress(Exception):
                await bus.js.delete_stream(stream)
        for bucket in (n.snapshot_bucket, n.profiler_snapshot_bucket):
            with contextlib.suppress(Exception):
                await bus.js.delete_object_store(bucket)
        with contextlib.suppress(Exception):
            names = [s.config.name for s in await bus.js.streams_info() if s.config.name]
            for name in names:
                if name.startswith(f"KV_{n.lease_bucket}"):
                    await bus.js.delete_stream(name)
    finally:
        await bus.close()

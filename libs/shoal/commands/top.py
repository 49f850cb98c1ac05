"""``shoal top``: a live terminal view of jobs, shares, nodes and GPU utilisation.

It replays the event log and then follows it on the same consumer, folding every
event into a :class:`~shoal.state.ClusterState` (the fold every service uses), and
redraws at most every ``--interval`` seconds when something changed. Plain ANSI
escapes, no curses: the frame is drawn in the terminal's alternate screen and the
terminal is restored on exit (Ctrl-C). ``--once`` prints one frame of the log as it
is now and exits; when stdout is not a terminal, frames are printed one after
another without escapes (and without colour; ``NO_COLOR`` also turns colour off).

Each job gets a letter; the node lines show which job holds each GPU (``.`` free,
``!`` unhealthy), so placement and packing are visible at a glance.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import string
import sys
from typing import TYPE_CHECKING, Any

from shoal.commands import _connect

if TYPE_CHECKING:
    from shoal.client import Client
    from shoal.events import Envelope
    from shoal.state import ClusterState, JobState

LETTERS = string.ascii_uppercase + string.ascii_lowercase + string.digits

_COLORS = {
    "running": "\x1b[32m",
    "pending": "\x1b[33m",
    "completed": "\x1b[2m",
    "cancelled": "\x1b[2m",
    "failed": "\x1b[31m",
    "rejected": "\x1b[31m",
    "lost": "\x1b[31m",
    "drained": "\x1b[33m",
}
_RESET = "\x1b[0m"
_BOLD = "\x1b[1m"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "top",
        help="live view of jobs, shares, nodes and GPU utilisation",
        description="A live terminal view fed by the event stream. Ctrl-C quits.",
    )
    p.add_argument("--once", action="store_true", help="print one frame of the current state and exit")
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between redraws (default 1)"
    )
    p.add_argument(
        "--frames", type=int, default=0, metavar="N", help="exit after N frames (0: run until Ctrl-C)"
    )
    p.add_argument("--finished", type=int, default=5, metavar="N", help="finished jobs to show (default 5)")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_top)


class Decision:
    """A share decision as ``top`` lists it: when, epoch, why, and the jobs it changed."""

    def __init__(self, at: float, epoch: int, trigger: str, changes: list[tuple[str, int, int]]) -> None:
        self.at = at
        self.epoch = epoch
        self.trigger = trigger
        self.changes = changes


class TopModel:
    """The folded state plus the recent share decisions, updated one event at a time."""

    def __init__(self, recent: int = 4) -> None:
        from shoal.state import ClusterState

        self.state: ClusterState = ClusterState()
        self.seq = 0
        self.events = 0
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=recent)
        self.letters: dict[str, str] = {}

    def apply(self, seq: int, env: Envelope) -> None:
        from shoal import events as ev
        from shoal import state as st

        e = env.event
        state = self.state
        if isinstance(e, ev.SharesDecided) and (e.epoch > state.shares_epoch or not state.shares_epoch):
            changes = []
            for job_id in sorted(state.shares.keys() | e.shares.keys()):
                job = state.jobs.get(job_id)
                if job is None or job.status in st.FINISHED_STATUSES:
                    continue
                old, new = job.gpus, e.shares.get(job_id, 0)
                if old != new:
                    changes.append((job_id, old, new))
            self.decisions.append(Decision(env.at, e.epoch, e.trigger, changes))
        st.apply(state, env)
        self.seq = max(self.seq, seq)
        self.events += 1

    def letter(self, job_id: str) -> str:
        """A stable one-character tag for a job (reused once the alphabet runs out)."""
        if job_id not in self.letters:
            self.letters[job_id] = LETTERS[len(self.letters) % len(LETTERS)]
        return self.letters[job_id]


def _bar(fraction: float | None, width: int = 10) -> str:
    if fraction is None:
        return "[" + "?" * width + "]"
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _paint(text: str, status: str, color: bool) -> str:
    code = _COLORS.get(status)
    return f"{code}{text}{_RESET}" if color and code else text


def render(
    model: TopModel,
    *,
    prefix: str = "shoal",
    width: int = 120,
    height: int = 40,
    color: bool = False,
    finished: int = 5,
) -> str:
    """One frame of ``shoal top`` as text (pure: reads the model only)."""
    from shoal import explain
    from shoal import state as st

    state = model.state
    total, _ = _gpus(state)
    allocated = sum(state.shares.values())
    utils = [g.utilization for n in state.nodes.values() if n.status == st.NODE_UP for g in n.gpus]
    util = sum(utils) / len(utils) if utils else 0.0
    counts = collections.Counter(j.status for j in state.jobs.values())
    done = sum(counts[s] for s in st.FINISHED_STATUSES)
    title = (
        f"shoal top · {prefix} · log time {explain.short_time(state.clock) if model.events else '-'} UTC"
        f" · seq {model.seq} · epoch {state.shares_epoch}" + (f" ({state.policy})" if state.policy else "")
    )
    summary = (
        f"GPUs {allocated}/{total} allocated, {max(0, total - allocated)} free · utilisation {util * 100:.0f}% · "
        f"jobs {counts['running']} running, {counts['pending']} pending, {done} finished"
    )
    lines = [_BOLD + title + _RESET if color else title, summary, ""]

    active = [(j, s) for j, s in state.jobs.items() if s.status not in st.FINISHED_STATUSES]
    active.sort(key=lambda js: (js[1].status != st.RUNNING, -js[1].gpus, js[1].submitted_at))
    ended = [(j, s) for j, s in state.jobs.items() if s.status in st.FINISHED_STATUSES]
    ended.sort(key=lambda js: -(js[1].finished_at or 0.0))
    shown = active + ended[: max(0, finished)]
    budget = max(3, height - 8 - len(state.nodes) - len(model.decisions))
    rows = [_job_line(model, j, s, color) for j, s in shown[:budget]]
    header = f"  {'JOB':<16} {'USER':<10} {'STATE':<9} {'GPUS':>4} {'TYPE':<6} {'PROGRESS':<26} {'GPU·S':>9}  NODES"
    lines.append(header)
    lines += rows if rows else ["  (no jobs)"]
    if len(shown) > budget:
        lines.append(f"  … {len(shown) - budget} more")
    lines.append("")

    lines.append(f"  {'NODE':<12} {'STATE':<7} {'TYPE':<6} {'GPUS':<18} UTILISATION")
    for node_id, node in sorted(state.nodes.items()):
        row = explain.node_row(node_id, node, state)
        gpu_map = "".join(
            "!" if not g.healthy else (model.letter(job) if job else ".")
            for g, job in zip(node.gpus, row["gpu_jobs"], strict=True)
        )
        status = _paint(f"{node.status:<7}", node.status, color and node.status != st.NODE_UP)
        lines.append(
            f"  {node_id[:12]:<12} {status} {','.join(row['gpu_types'])[:6]:<6} {gpu_map:<18} "
            f"{_bar(row['utilization'])} {row['utilization'] * 100:3.0f}%"
        )
    if not state.nodes:
        lines.append("  (no nodes)")
    if model.decisions:
        lines.append("")
        lines.append("  recent share decisions")
        for d in reversed(model.decisions):
            change = ", ".join(f"{j} {a}→{b}" for j, a, b in d.changes[:8]) or "no change to active jobs"
            if len(d.changes) > 8:
                change += f", +{len(d.changes) - 8}"
            lines.append(
                f"  {explain.short_time(d.at)[11:]} epoch {d.epoch:<5} {d.trigger or '?':<12} {change}"
            )
    return "\n".join(line[:width] if not color else line for line in lines)


def _gpus(state: ClusterState) -> tuple[int, dict[str, int]]:
    from shoal.view import cluster_gpus

    return cluster_gpus(state)


def _job_line(model: TopModel, job_id: str, job: JobState, color: bool) -> str:
    from shoal import explain

    frac = explain.progress(job)
    total = explain.total_work(job)
    prog = f"{_bar(frac)} {frac * 100:3.0f}%" if frac is not None else f"{job.iteration} it"
    if total:
        prog += f" {_short_count(job.iteration)}/{_short_count(total)}"
    tag = model.letter(job_id) if job.placement else " "
    status = _paint(f"{job.status:<9}", job.status, color)
    service = explain._service(job, model.state.clock)
    return (
        f"{tag} {job_id[:16]:<16} {job.spec.user[:10]:<10} {status} {job.gpus:>4} {job.gpu_type[:6]:<6} "
        f"{prog:<26} {service:>9.0f}  {explain.placement_text(job.placement)}"
    )


def _short_count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.0f}k"
    return str(n)


def cmd_top(args: argparse.Namespace) -> int:
    prefix = _connect.resolve_prefix(args.prefix)
    tty = sys.stdout.isatty()
    color = tty and not os.environ.get("NO_COLOR")

    def frame(model: TopModel) -> str:
        size = shutil.get_terminal_size((120, 40))
        return render(
            model, prefix=prefix, width=size.columns, height=size.lines, color=color, finished=args.finished
        )

    async def once(client: Client) -> int:
        model = TopModel()
        async for batch in client.history():
            for seq, env in batch:
                model.apply(seq, env)
        print(frame(model))
        return 0

    async def live(client: Client) -> int:
        import nats.js.errors

        model = TopModel()
        changed = asyncio.Event()
        stop = asyncio.Event()

        async def follow() -> None:
            async for batch in client.bus.replay_batches(follow=True, stop=stop, idle_expires_s=0.5):
                for seq, env in batch:
                    model.apply(seq, env)
                model.seq = max(model.seq, batch.last_seq)  # skipped (unknown) events count as read
                changed.set()

        target, _ = await client.last_event()
        task = asyncio.create_task(follow())
        frames = 0
        if tty:
            sys.stdout.write("\x1b[?1049h\x1b[?25l")
        try:
            first = True
            while not task.done():
                if first and model.seq < target:
                    # Draw the first frame once the history is folded, not an empty one.
                    await asyncio.wait([task], timeout=0.05)
                    continue
                if first or changed.is_set():
                    changed.clear()
                    text = frame(model)
                    if tty:
                        sys.stdout.write("\x1b[H" + text.replace("\n", "\x1b[K\n") + "\x1b[K\x1b[J")
                    else:
                        sys.stdout.write(text + "\n\n")
                    sys.stdout.flush()
                    frames += 1
                    first = False
                    if args.frames and frames >= args.frames:
                        break
                await asyncio.wait([task], timeout=max(0.01, args.interval))
            if task.done() and task.exception() is not None:
                exc = task.exception()
                if isinstance(exc, nats.js.errors.NotFoundError):
                    raise client._no_log()
                raise exc  # type: ignore[misc]
        finally:
            stop.set()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            if tty:
                sys.stdout.write("\x1b[?25h\x1b[?1049l")
                sys.stdout.flush()
        return 0

    if args.interval <= 0:
        from shoal.cli import CommandError

        raise CommandError(f"--interval must be positive, got {args.interval}")
    return _connect.run(args, once if args.once else live)

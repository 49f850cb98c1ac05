"""``shoal replay --until <time>``: the cluster as it was at any past moment.

The log is folded from its start up to the moment (see :func:`shoal.explain.fold_until`):
``seq:<n>`` (a stream sequence), an ISO 8601 time (UTC unless it has an offset),
``@<unix seconds>``, or a time relative to now such as ``-5m`` or ``-1h30m`` (write
``--until=-5m``, or ``--ago 5m``: argparse reads a bare ``-5m`` as a flag). "Now"
is the later of the wall clock and the newest event's time, so relative times also
work on an emulated installation, whose log runs on a faster virtual clock.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from shoal.cli import CommandError
from shoal.commands import _connect

if TYPE_CHECKING:
    from shoal.client import Client


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="rebuild the cluster state as it was at a past moment",
        description="Fold the event log up to a moment and print the cluster: jobs by state with "
        "their GPUs, nodes, shares and epoch, and the state digest.",
    )
    p.add_argument(
        "--until",
        metavar="WHEN",
        help="seq:<n>, an ISO time (2026-11-23T01:30:00Z), @<unix seconds> or relative "
        "(--until=-5m, --until=-1h30m); default: the whole log",
    )
    p.add_argument("--ago", metavar="DURATION", help="same as --until=-DURATION, e.g. --ago 5m")
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from shoal import explain

    if args.ago is not None:
        if args.until is not None:
            raise CommandError("give --until or --ago, not both")
        args.until = "-" + args.ago.lstrip("-")
    if args.until is not None:
        try:  # check the syntax before connecting
            explain.parse_until(args.until, time.time())
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    async def body(client: Client) -> int:
        until = None
        if args.until is not None:
            _, last = await client.last_event()
            now = max(time.time(), last.at if last is not None else 0.0)
            until = explain.parse_until(args.until, now)
        replayer = explain.Replayer(until)
        async for batch in client.history():
            if not all(replayer.feed(seq, env) for seq, env in batch):
                break
        summary = explain.summarize(replayer.result, until)
        if args.json:
            _connect.print_json(summary)
        else:
            print(explain.render_summary(summary))
        return 0

    return _connect.run(args, body)

"""``shoal compact``: remove the progress reports that no fold needs.

The event log keeps every ``ProgressReported`` a running job makes (about one per
``SHOAL_REPORT_MAX_EVERY_S``), so it grows with job-hours. A fold keeps from them only
the one with the highest iteration. This command:

1. reads the stream sequences of the newest cluster and profiler snapshots (the
   *horizon*: services start from them and read only what follows);
2. folds the log to its current end, noting each job's reports
   (:class:`shoal.compaction.ProgressLedger`), and picks, per job, the sequence below
   which its reports may go: only reports below the horizon and stamped ``--older-than``
   (default a week) before the log's newest instant go, and the newest of them that the
   fold keeps stays;
3. folds the log again without those reports, and stops with an error, removing
   nothing, unless both folds have the same digest;
4. removes them, one JetStream purge per job of that job's progress subject below its
   point (``$JS.API.STREAM.PURGE`` with ``filter`` and ``seq``).

Each step reads the log as it was at step 2's end (later messages are left out), so
events appended meanwhile never make the check differ.

Only the admin identity may purge (:mod:`shoal.auth` denies it to every other role).
``shoal up`` runs it every ``SHOAL_COMPACT_EVERY_S`` (:mod:`shoal.commands.up`).
Tested by ``tests/test_compaction.py`` against a real nats-server.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from msgspec import Struct

from shoal.cli import CommandError

DEFAULT_OLDER_THAN_S = 7 * 86400.0
"""``--older-than``'s default (and ``SHOAL_COMPACT_AFTER_S``'s)."""


class Compaction(Struct, kw_only=True):
    """What one compaction found and did."""

    horizon: int
    last_seq: int
    jobs: int
    """Jobs whose reports were (with ``dry_run``: would be) removed."""
    reports: int
    """Reports removed (with ``dry_run``: removable)."""
    messages_before: int
    messages_after: int
    digest: str
    dry_run: bool = False


def register(subparsers: Any) -> None:
    from shoal.commands._connect import add_connection_args

    p = subparsers.add_parser(
        "compact",
        help="remove the progress reports that no fold of the log needs (admin only)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    p.add_argument(
        "--older-than",
        type=float,
        default=DEFAULT_OLDER_THAN_S,
        metavar="S",
        help="only reports made at least S seconds before the log's newest event "
        f"(default {DEFAULT_OLDER_THAN_S:g}: a week); newer ones stay, so `shoal explain` and "
        "`shoal replay --until` see that week report by report",
    )
    add_connection_args(p)
    p.set_defaults(func=_compact)


async def horizon(bus: Any, last_seq: int) -> int:
    """The oldest stream sequence the newest cluster and profiler snapshots cover, plus
    one (``last_seq + 1`` when there is none: every service then folds the whole log)."""
    from shoal.profiling.snapshot import PROFILER_SNAPSHOT
    from shoal.projection import CLUSTER_SNAPSHOT

    seqs = []
    for name, bucket in (
        (CLUSTER_SNAPSHOT, bus.names.snapshot_bucket),
        (PROFILER_SNAPSHOT, bus.names.profiler_snapshot_bucket),
    ):
        snap = await bus.load_snapshot(name, bucket=bucket)
        if snap is not None:
            seqs.append(snap.seq)
    return min(seqs, default=last_seq) + 1


async def newest_instant(bus: Any, end: int, tries: int = 100) -> float:
    """The occurred-at of the newest message up to ``end`` that decodes (of the last
    ``tries``; ``-inf`` when none does, and then no report is old enough to go)."""
    import nats.js.errors

    from shoal import codec

    for seq in range(end, max(0, end - tries), -1):
        try:
            msg = await bus.js.get_msg(bus.names.events_stream, seq)
            return float(codec.decode(msg.data).at)
        except nats.js.errors.NotFoundError:
            continue
        except codec.DecodeFailure:
            continue
    return float("-inf")


async def compact(
    bus: Any, *, dry_run: bool = False, older_than_s: float = DEFAULT_OLDER_THAN_S, timeout_s: float = 10.0
) -> Compaction:
    """Run one compaction on ``bus`` (an admin's connection); see the module docstring.
    Only reports stamped ``older_than_s`` or more before the log's newest instant go;
    ``timeout_s`` bounds each JetStream request.

    Raises:
        CommandError: the fold without the reports would differ (nothing removed), or
            the server refused a purge.
    """
    from shoal import events as ev
    from shoal.compaction import ProgressLedger, kept
    from shoal.state import ClusterState, apply, digest

    stream = bus.names.events_stream
    # Whether this identity may purge at all, before the folds: a purge of a subject no
    # event is ever on removes nothing, and the server drops it unanswered for every role
    # but the admin (nats TimeoutError or NoRespondersError).
    probe = await bus.nc.request(
        f"$JS.API.STREAM.PURGE.{stream}",
        json.dumps({"filter": f"{bus.names.prefix}.compact.probe"}).encode(),
        timeout=timeout_s,
    )
    del probe  # any answer, an error included, means the server let the request through
    info = await bus.js.stream_info(stream)
    end = int(info.state.last_seq)
    before = int(info.state.messages)
    limit = min(await horizon(bus, end), end + 1)
    ledger = ProgressLedger(horizon=limit, cutoff=await newest_instant(bus, end) - older_than_s)
    progress = f"{bus.names.prefix}.job."
    async for batch in bus.replay_batches():
        for skipped in batch.skipped:
            subject = skipped.subject
            if skipped.seq <= end and subject.startswith(progress) and subject.endswith(".progress"):
                ledger.skipped(subject[len(progress) : -len(".progress")])
        for seq, env in batch:
            if seq <= end:
                ledger.apply(seq, env)
        if batch.last_seq >= end:
            break
    points = ledger.purge_points()
    full = digest(ledger.state)

    state = ClusterState()
    async for seq, env in bus.replay():
        if seq > end:
            break
        if kept(seq, env, points):
            apply(state, env)
    compacted = digest(state)
    if compacted != full:
        raise CommandError(
            f"nothing removed: the log folded without the {ledger.removable(points)} reports "
            f"would differ from the whole log's fold ({compacted[:12]} != {full[:12]})",
            code=1,
        )
    removed = 0
    if not dry_run:
        for job_id, point in sorted(points.items()):
            subject = bus.names.subject(ev.ProgressReported(job_id=job_id, iteration=0))
            reply = await bus.nc.request(
                f"$JS.API.STREAM.PURGE.{stream}",
                json.dumps({"filter": subject, "seq": point}).encode(),
                timeout=timeout_s,
            )
            body = json.loads(reply.data)
            if body.get("error"):
                raise CommandError(f"purge of {subject}: {body['error'].get('description', body['error'])}")
            removed += int(body.get("purged", 0))
    after = int((await bus.js.stream_info(stream)).state.messages)
    return Compaction(
        horizon=limit,
        last_seq=end,
        jobs=len(points),
        reports=removed if not dry_run else ledger.removable(points),
        messages_before=before,
        messages_after=after,
        digest=full,
        dry_run=dry_run,
    )


def _compact(args: argparse.Namespace) -> int:
    from shoal.commands.backup import _connect, _run

    async def main() -> int:
        import nats.errors

        bus = await _connect(args)
        try:
            try:
                result = await compact(
                    bus, dry_run=args.dry_run, older_than_s=args.older_than, timeout_s=args.timeout
                )
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                raise CommandError(
                    f"no answer from JetStream ({type(exc).__name__}): only the admin identity may "
                    "compact the log (are these the admin's credentials?)",
                    code=1,
                ) from None
        finally:
            await bus.close()
        verb = "would remove" if result.dry_run else "removed"
        print(
            f"{verb} {result.reports} progress reports of {result.jobs} jobs "
            f"(log up to seq {result.last_seq}, snapshots cover below {result.horizon}); "
            f"messages {result.messages_before} -> {result.messages_after}; "
            f"fold digest {result.digest[:12]} unchanged"
        )
        return 0

    return _run(main, args.timeout)

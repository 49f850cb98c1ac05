"""Compaction of the event log: which progress reports no fold needs.

A running job reports its progress (``ProgressReported``, on its own subject
``<prefix>.job.<id>.progress``) about once per ``SHOAL_REPORT_MAX_EVERY_S``, so those
reports grow the log with job-hours (``docs/durability.md``, "Retention"). Most of them
are dead weight: the fold (:mod:`shoal.state`) keeps from them only the report with the
highest iteration (its iteration, loss, rate and instant), and the profiler starts
from its own snapshot, which holds its measurements.

This module is the pure half of ``shoal compact`` (:mod:`shoal.commands.compact`):
:class:`ProgressLedger` reads the log once, alongside a fold, and
:meth:`ProgressLedger.purge_points` names, per job, finished or running, a stream
sequence below which that job's progress reports may be removed without changing what
any fold of the log to its end gives, from its first message or from any snapshot.
The report kept, ``D``, is the last one whose iteration is at least that of every
earlier one of the job, among the reports that may go at all: those below the
*horizon* (the oldest stream sequence that the newest cluster and profiler snapshots
cover, so a service starting from one of them never reads across a removal) and
stamped at or before the *cutoff* (``--older-than`` before the log's newest instant).
``D`` stops moving at the job's first report that may not go, and at its end. The
fold's progress fields come from ``D`` alone, whatever state a fold reaches it from:
reports before it can only be overwritten by it. A job keeps every report when:

- its first report is what started it (no ``ReconfigurationStarted`` or
  ``JobStarted`` came first): removing it would change ``started_at``;
- a report before ``D`` is stamped later than ``D``: removing it would move the
  fold's clock (the newest instant seen);
- a message on its progress subject did not decode (a purge by subject would also
  take one the check never read, e.g. of a newer schema version).

What is lost is the past: a fold that stops at an instant before ``D`` (``shoal
replay --until``, ``shoal explain``) sees the job's progress only as of the reports
left, which is why only reports older than the cutoff go. A running job keeps its
reports of the last ``--older-than`` and the newest older one; a finished one, once
its last report is that old, one.

The command also folds the log both ways and removes nothing unless the two
digests are equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec import Struct

from shoal import events as ev
from shoal.events import Envelope
from shoal.state import FINISHED_STATUSES, PENDING, ClusterState, apply


class _Reports(Struct, kw_only=True):
    kept_seq: int = 0
    """Sequence of the report the fold's progress fields come from (``D``)."""
    kept_iteration: int = -1
    kept_at: float = float("-inf")
    removable: int = 0
    """Reports before ``D``."""
    since_kept: int = 0
    """Reports after ``D`` that the fold ignored (they go with a later ``D``)."""
    since_kept_at: float = float("-inf")
    latest_removable_at: float = float("-inf")
    """Newest occurred-at among the reports before ``D``."""
    frozen: bool = False
    """A report past the horizon or newer than the cutoff came: ``D`` stays where it is,
    since a purge below a later one would take that report too."""
    started_by_report: bool = False
    unread: bool = False
    """A message on the job's progress subject did not decode here (malformed, of a
    newer version...): the check cannot vouch for it, so the job is left whole."""


class ProgressLedger:
    """Folds the log and records, per job, what :meth:`purge_points` needs.

    Feed it every ``(stream sequence, envelope)`` of the log in order with
    :meth:`apply`; :attr:`state` is then the full fold.

    Args:
        horizon: Reports at or past this stream sequence stay (see the module docstring).
        cutoff: Reports whose occurred-at is later than this stay.
    """

    def __init__(self, horizon: float = float("inf"), cutoff: float = float("inf")) -> None:
        self.state = ClusterState()
        self.jobs: dict[str, _Reports] = {}
        self.last_seq = 0
        self.horizon = horizon
        self.cutoff = cutoff

    def apply(self, seq: int, env: Envelope) -> None:
        e = env.event
        if isinstance(e, ev.ProgressReported):
            job = self.state.jobs.get(e.job_id)
            r = self.jobs.setdefault(e.job_id, _Reports())
            if seq >= self.horizon or env.at > self.cutoff:
                r.frozen = True
            elif not r.frozen and (job is None or job.status not in FINISHED_STATUSES):
                if job is not None and r.kept_seq == 0 and job.status == PENDING:
                    r.started_by_report = True
                if job is not None and e.iteration >= r.kept_iteration:
                    # The new D: every report before it may go.
                    if r.kept_seq:
                        r.removable += 1 + r.since_kept
                        r.latest_removable_at = max(r.latest_removable_at, r.kept_at, r.since_kept_at)
                    elif r.since_kept:
                        r.removable += r.since_kept
                        r.latest_removable_at = max(r.latest_removable_at, r.since_kept_at)
                    r.kept_seq, r.kept_iteration, r.kept_at = seq, e.iteration, env.at
                    r.since_kept, r.since_kept_at = 0, float("-inf")
                else:
                    # Below D's iteration (a restart from a checkpoint), or of a job not
                    # submitted yet: the fold ignores it; it goes only with a later D.
                    r.since_kept += 1
                    r.since_kept_at = max(r.since_kept_at, env.at)
            else:
                # After the job's end: the fold ignores it, and it stays (it is after D).
                r.frozen = True
        apply(self.state, env)
        self.last_seq = seq

    def skipped(self, job_id: str) -> None:
        """A message on ``job_id``'s progress subject that the replay skipped."""
        self.jobs.setdefault(job_id, _Reports()).unread = True

    def purge_points(self) -> dict[str, int]:
        """Job id -> stream sequence: the job's progress reports below it may go."""
        out: dict[str, int] = {}
        for job_id, r in sorted(self.jobs.items()):
            if not r.kept_seq or not r.removable or r.started_by_report or r.unread:
                continue
            if r.latest_removable_at > r.kept_at:
                continue
            out[job_id] = r.kept_seq
        return out

    def removable(self, points: Mapping[str, int]) -> int:
        """How many reports ``points`` remove."""
        return sum(self.jobs[j].removable for j in points)


def kept(seq: int, env: Envelope, points: Mapping[str, int]) -> bool:
    """Whether the message at ``seq`` stays once ``points`` are applied."""
    e = env.event
    return not (isinstance(e, ev.ProgressReported) and seq < points.get(e.job_id, 0))


def compacted_fold(items: Iterable[tuple[int, Envelope]], points: Mapping[str, int]) -> ClusterState:
    """The fold of the log as it will be once ``points`` are applied: each job's
    progress reports below its point are left out."""
    state = ClusterState()
    for seq, env in items:
        if kept(seq, env, points):
            apply(state, env)
    return state

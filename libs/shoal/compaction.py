"""Compaction of the event log: which progress reports of finished jobs can go.

A running job reports its progress (``ProgressReported``, on its own subject
``<prefix>.job.<id>.progress``) about once per ``SHOAL_REPORT_MAX_EVERY_S``, so those
reports grow the log with job-hours (``docs/durability.md``, "Retention"). Once a job
has finished, all but one of them are dead weight: the fold (:mod:`shoal.state`) keeps
from them only the report with the highest iteration (its iteration, loss, rate and
instant), and the profiler forgets a finished job's measurements.

This module is the pure half of ``shoal compact`` (:mod:`shoal.commands.compact`):
:class:`ProgressLedger` reads the log once, alongside a fold, and
:meth:`ProgressLedger.purge_points` names, per finished job, a stream sequence below
which that job's progress reports may be removed without changing what any fold of
the log to its end gives, from its first message or from any snapshot. A job is
compacted only when all of these hold:

- its terminal event (completion, failure, cancellation, rejection) is below the
  *horizon*: the oldest stream sequence a snapshot that a service may start from
  covers (the newest cluster and profiler snapshots), so a service that starts from
  one of them never reads across a removal;
- the report kept, ``D``, is the last one folded while the job was active whose
  iteration is at least that of every earlier one: the fold's progress fields come
  from ``D`` alone, whatever state a fold reaches it from (reports before ``D`` can
  only be overwritten by it);
- the job was already running when its first report was folded (a
  ``ReconfigurationStarted``/``JobStarted`` came first), so no removed report is
  the one that started it;
- no removed report is later (``at``) than the job's terminal event, so the fold's
  clock (the newest instant seen) does not move either;
- every message on the job's progress subject decoded (a purge by subject would also
  take one the check never read, e.g. of a newer schema version);
- it ended at least ``older_than`` before the log's newest instant (the command's
  ``--older-than``): a fold that stops at an instant before the job's end
  (``shoal replay --until``, ``shoal explain``) sees the job's progress only as of a
  kept report, so recent jobs stay whole for those.

The command also folds the log both ways and removes nothing unless the two
digests are equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec import Struct

from shoal import events as ev
from shoal.events import Envelope
from shoal.state import FINISHED_STATUSES, PENDING, ClusterState, apply

_TERMINAL = (ev.JobCompleted, ev.JobFailed, ev.JobCancelled, ev.JobRejected)


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
    started_by_report: bool = False
    terminal_seq: int = 0
    terminal_at: float = 0.0
    unread: bool = False
    """A message on the job's progress subject did not decode here (malformed, of a
    newer version...): the check cannot vouch for it, so the job is left whole."""


class ProgressLedger:
    """Folds the log and records, per job, what :meth:`purge_points` needs.

    Feed it every ``(stream sequence, envelope)`` of the log in order with
    :meth:`apply`; :attr:`state` is then the full fold.
    """

    def __init__(self) -> None:
        self.state = ClusterState()
        self.jobs: dict[str, _Reports] = {}
        self.last_seq = 0

    def apply(self, seq: int, env: Envelope) -> None:
        e = env.event
        if isinstance(e, ev.ProgressReported):
            job = self.state.jobs.get(e.job_id)
            if job is None or job.status not in FINISHED_STATUSES:
                r = self.jobs.setdefault(e.job_id, _Reports())
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
        elif isinstance(e, _TERMINAL):
            job = self.state.jobs.get(e.job_id)
            if job is not None and job.status not in FINISHED_STATUSES:
                r = self.jobs.setdefault(e.job_id, _Reports())
                r.terminal_seq, r.terminal_at = seq, env.at
        apply(self.state, env)
        self.last_seq = seq

    def skipped(self, job_id: str) -> None:
        """A message on ``job_id``'s progress subject that the replay skipped."""
        self.jobs.setdefault(job_id, _Reports()).unread = True

    def purge_points(self, horizon: int, ended_before: float = float("inf")) -> dict[str, int]:
        """Job id -> stream sequence: the job's progress reports below it may go.

        Args:
            horizon: Only jobs whose terminal event's sequence is below this are
                compacted (see the module docstring).
            ended_before: ... and whose terminal event's occurred-at is at most this.
        """
        out: dict[str, int] = {}
        for job_id, r in sorted(self.jobs.items()):
            job = self.state.jobs.get(job_id)
            if job is None or job.status not in FINISHED_STATUSES or not r.terminal_seq:
                continue
            if r.terminal_seq >= horizon or r.terminal_at > ended_before:
                continue
            if not r.removable or r.started_by_report or r.unread:
                continue
            if r.latest_removable_at > r.terminal_at:
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

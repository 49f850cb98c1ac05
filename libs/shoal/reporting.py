"""When a running job's next periodic ``ProgressReported`` is due.

Progress reports go to the event log, which is kept for ever (``docs/durability.md``).
At a fixed interval they grow the log with job-hours: at the old 0.25 s, one running
job appended 345,600 events a day. What reads them needs them most just after a change
of shape (the profiler measures the new GPU count, overestimate-first probes the next
unit, CoDDL §4.5) and little in a long steady stretch, where the allocator carries
progress forward from the newest report at the current share's throughput
(:func:`shoal.progress.carry_progress_forward`) and a trainer reports at every change
instant anyway.

So the interval backs off: it is ``first_s`` after each change (a start, a
reconfiguration completed), doubles after each report and stays at ``max_s``. A job
that runs ``T`` seconds on one shape reports about ``log2(max_s/first_s) + T/max_s``
times instead of ``T/first_s``. ``max_s == first_s`` is the old fixed interval.

One report more is due at the end of the profiler's measurement window of the new
shape (``window_at``, given with :meth:`ReportBackoff.changed`): the profiler counts a
GPU count as measured only from a report made after that window
(``SHOAL_PROFILER_MIN_INTERVAL_S``), and in an emulated installation it holds the
shared clock there until one comes. Without it, the doubling put that report up to
``max_s`` late, and for a shape shorter than that never (a Gandiva_fair trading test
through ``shoal up`` stalled so on a loaded machine).

Chosen over a side stream of progress outside the log: the fold, the profiler and a
replay keep reading progress from one ordered log. The log still grows with job-hours,
by one report per ``max_s`` per running job.
"""

from __future__ import annotations

import math


def measurement_window_end(resumed_at: float, window_s: float) -> float:
    """The end of the profiler's measurement window of a shape that began (its
    reconfiguration completed) at ``resumed_at``: ``window_s`` later, rounded up to a
    whole second. The profiler measures from reports at or after it; an emulated trainer
    reports there."""
    return float(math.ceil(resumed_at + window_s - 1e-6))


class ReportBackoff:
    """The interval between a job's periodic progress reports (module docstring)."""

    def __init__(self, first_s: float, max_s: float | None = None) -> None:
        if first_s <= 0:
            raise ValueError(f"first report interval must be > 0, got {first_s}")
        self.first_s = first_s
        self.max_s = first_s if max_s is None else max(first_s, max_s)
        """The largest interval; one below ``first_s`` is ``first_s`` (a fixed interval)."""
        self.interval_s = first_s
        """Seconds from the newest report to the next one."""
        self.window_at: float | None = None
        """An instant at which a report is due whatever the interval (the end of the
        newest shape's measurement window), on the clock the caller passes as ``now``;
        None once a report at or after it went out."""

    def changed(self, window_at: float | None = None) -> None:
        """The job changed shape (or started): report often again, and at ``window_at``."""
        self.interval_s = self.first_s
        self.window_at = window_at

    def reported(self, now: float | None = None) -> None:
        """A periodic report went out (at ``now``): the next one is due twice as late,
        up to ``max_s``."""
        self.interval_s = min(self.max_s, self.interval_s * 2)
        if self.window_at is not None and now is not None and now >= self.window_at:
            self.window_at = None

    def due(self, since_last_s: float, now: float | None = None) -> bool:
        """Whether a report is due ``since_last_s`` seconds after the newest one, at ``now``."""
        if since_last_s >= self.interval_s:
            return True
        return self.window_at is not None and now is not None and now >= self.window_at

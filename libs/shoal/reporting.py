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

Chosen over a side stream of progress outside the log: the fold, the profiler and a
replay keep reading progress from one ordered log. The log still grows with job-hours,
by one report per ``max_s`` per running job.
"""

from __future__ import annotations


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

    def changed(self) -> None:
        """The job changed shape (or started): report often again."""
        self.interval_s = self.first_s

    def reported(self) -> None:
        """A periodic report went out: the next one is due twice as late, up to ``max_s``."""
        self.interval_s = min(self.max_s, self.interval_s * 2)

    def due(self, since_last_s: float) -> bool:
        """Whether a report is due ``since_last_s`` seconds after the newest one."""
        return since_last_s >= self.interval_s

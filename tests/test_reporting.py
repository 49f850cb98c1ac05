"""The progress-report interval (:mod:`shoal.reporting`)."""

from __future__ import annotations

import pytest
from shoal.reporting import ReportBackoff


def test_the_interval_doubles_to_the_maximum_and_starts_over_at_a_change() -> None:
    r = ReportBackoff(0.25, 30.0)
    seen = []
    for _ in range(10):
        seen.append(r.interval_s)
        r.reported()
    assert seen == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert r.due(30.0) and not r.due(29.9)
    r.changed()
    assert r.interval_s == 0.25 and r.due(0.25) and not r.due(0.2)


def test_no_maximum_or_one_below_the_first_is_a_fixed_interval() -> None:
    for r in (ReportBackoff(1.0), ReportBackoff(1.0, 0.5), ReportBackoff(1.0, 1.0)):
        for _ in range(5):
            r.reported()
        assert r.interval_s == 1.0 and r.max_s == 1.0


def test_a_first_interval_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="> 0"):
        ReportBackoff(0.0)


def test_a_report_is_due_at_the_end_of_the_measurement_window_whatever_the_interval() -> None:
    r = ReportBackoff(1.0, 30.0)
    for _ in range(4):
        r.reported()
    r.changed(window_at=100.0)
    assert r.interval_s == 1.0
    for _ in range(4):
        r.reported(now=50.0)  # reports before the window's end keep it due
    assert r.interval_s == 16.0 and r.window_at == 100.0
    assert not r.due(10.0, now=99.0)
    assert r.due(10.0, now=100.0), "due at the window's end though the interval is 16 s"
    r.reported(now=100.0)
    assert r.window_at is None and not r.due(10.0, now=101.0)

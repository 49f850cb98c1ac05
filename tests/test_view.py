"""The allocator's view: running jobs' progress carried to the decision instant."""

from __future__ import annotations

import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.progress import carry_progress_forward
from shoal.view import build_view

# 10 iterations/s on 2 GPUs (a table model), 1,000,000 iterations in all.
CURVE = ev.ThroughputModelUpdated(job_id="a", gpu_type="", model_kind="table", throughput={1: 6.0, 2: 10.0})


def _view_at(history: list[ev.Envelope], now: float, resumed: dict[str, float]) -> float | None:
    state = st.fold(history)
    view = carry_progress_forward(build_view(state, now=now), state, now, resumed)
    (job,) = [j for j in view.jobs if j.job_id == "a"]
    return job.iterations_done


def _history(report_at: float) -> list[ev.Envelope]:
    spec = ev.JobSpec(user="u", max_gpus=2, total_iterations=1_000_000)
    return [
        codec.wrap(ev.JobSubmitted(job_id="a", spec=spec), at=0.0),
        codec.wrap(CURVE, at=0.0),
        codec.wrap(ev.SharesDecided(epoch=1, shares={"a": 2}), at=100.0),
        codec.wrap(ev.ProgressReported(job_id="a", iteration=500, num_gpus=2, epoch=1), at=report_at),
    ]


def test_progress_runs_on_from_the_newest_report_at_the_share_s_throughput() -> None:
    # Reported 500 at t=400 (after the change and its stop): 500 + 10/s × 100 s at t=500.
    assert _view_at(_history(400.0), 500.0, {"a": 130.0}) == pytest.approx(1500.0)


def test_progress_resumes_only_after_the_stop_of_the_newest_change() -> None:
    # The newest report predates the change at t=100 (the job waited); the change's
    # stop ended at t=130, so 370 s of progress at 10/s by t=500.
    history = _history(50.0)
    assert _view_at(history, 500.0, {"a": 130.0}) == pytest.approx(500 + 10.0 * 370)
    # Not yet reported complete: from the change itself.
    assert _view_at(history, 500.0, {}) == pytest.approx(500 + 10.0 * 400)
    # A completion of an older change does not count.
    assert _view_at(history, 500.0, {"a": 20.0}) == pytest.approx(500 + 10.0 * 400)


def test_waiting_jobs_are_left_as_they_are_and_unreported_running_ones_run_from_their_start() -> None:
    spec = ev.JobSpec(user="u", max_gpus=2, total_iterations=1_000_000)
    history = [codec.wrap(ev.JobSubmitted(job_id="a", spec=spec), at=0.0), codec.wrap(CURVE, at=0.0)]
    assert _view_at(history, 500.0, {}) == 0.0
    history.append(codec.wrap(ev.SharesDecided(epoch=1, shares={"a": 2}), at=100.0))
    # Running, never reported: from its start at t=100, or from the end of its stop once
    # that is reported (the simulator's exact progress; a job left at 0 until its first
    # report lost its GPUs to a tied arrival in the live stack only).
    assert _view_at(history, 500.0, {}) == pytest.approx(10.0 * 400)
    assert _view_at(history, 500.0, {"a": 130.0}) == pytest.approx(10.0 * 370)
    assert _view_at(history, 100.0, {}) == 0.0


def test_carried_progress_never_passes_the_total() -> None:
    assert _view_at(_history(400.0), 1e9, {"a": 130.0}) == 1_000_000.0

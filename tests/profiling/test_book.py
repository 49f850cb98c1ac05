"""The profiler's pure core: folding reports into a book and proposing updates."""

from __future__ import annotations

import math
from typing import Any

import pytest
from shoal import events as ev
from shoal import state as st
from shoal.profiling import (
    OVERESTIMATE_KIND,
    ProfileBook,
    ProfileParams,
    Reason,
    convergence_update,
    throughput_update,
)
from shoal.profiling.ratelimit import (
    FIRST,
    FLAG,
    MATERIAL,
    TOO_SOON,
    UNCHANGED,
    is_publish,
    next_due,
    publish_decision,
    relative_change,
)
from shoal.profiling.speed import MODEL_KIND


def job(**spec: Any) -> st.JobState:
    return st.JobState(spec=ev.JobSpec(user="u", max_gpus=8, **spec))


def rep(gpus: int, iteration: int = 1, **kw: Any) -> ev.ProgressReported:
    return ev.ProgressReported(job_id="j", iteration=iteration, num_gpus=gpus, **kw)


def test_rate_sources_in_order_of_preference() -> None:
    book = ProfileBook()
    j = job(global_batch_size=64)
    assert book.observe(1, rep(1, step_time_s=0.5, samples_per_s=999.0), 0.0, j) == []
    assert book.observe(2, rep(2, samples_per_s=256.0), 0.0, j) == []
    assert book.measured("j", "") == {1: 2.0, 2: 4.0}
    # No explicit rate: iterations between two reports with the same configuration.
    assert book.observe(3, rep(4, iteration=100), 10.0, j) == [Reason.NO_RATE]
    assert book.observe(4, rep(4, iteration=160), 20.0, j) == []
    assert book.measured("j", "")[4] == pytest.approx(6.0)
    assert book.basis[("j", "")] == 4


def test_gpu_type_and_count_fall_back_to_the_job_state() -> None:
    book = ProfileBook()
    j = job()
    j.gpu_type, j.world_size = "V100", 2
    book.observe(1, rep(0, samples_per_s=5.0), 0.0, j)
    assert book.measured("j", "V100") == {2: 5.0}
    j.world_size = 0
    assert book.observe(2, rep(0, samples_per_s=5.0), 0.0, j) == [Reason.NO_GPUS]


@pytest.mark.parametrize(
    ("report", "reason"),
    [
        (rep(1, samples_per_s=math.inf), Reason.NONFINITE_RATE),
        (rep(1, samples_per_s=math.nan), Reason.NONFINITE_RATE),
        (rep(1, step_time_s=-1.0), Reason.NEGATIVE_RATE),
        (rep(1, samples_per_s=-1.0), Reason.NEGATIVE_RATE),
        (rep(1, samples_per_s=1e9), Reason.IMPLAUSIBLE_RATE),
        (rep(9, samples_per_s=1.0), Reason.GPUS_OVER_MAX),
    ],
)
def test_nonsense_rates_are_rejected_and_counted(report: ev.ProgressReported, reason: Reason) -> None:
    book = ProfileBook()
    book.observe(1, rep(1, samples_per_s=3.0), 0.0, job())
    assert book.observe(2, report, 0.0, job()) == [reason]
    assert book.rejected == {reason.value: 1}
    assert book.measured("j", "") == {1: 3.0}


def test_bad_loss_does_not_lose_the_rate_and_vice_versa() -> None:
    book = ProfileBook()
    assert book.observe(1, rep(1, samples_per_s=3.0, loss=math.nan), 0.0, job()) == [Reason.NONFINITE_LOSS]
    assert book.observe(2, rep(1, samples_per_s=-3.0, loss=0.5), 0.0, job()) == [Reason.NEGATIVE_RATE]
    assert book.observe(3, rep(1, samples_per_s=3.0, loss=-0.5), 0.0, job()) == [Reason.NEGATIVE_LOSS]
    assert book.measured("j", "") == {1: 3.0}
    assert book.losses["j"] == [(1, 0.5)]


def test_unknown_and_finished_jobs() -> None:
    book = ProfileBook()
    assert book.observe(1, rep(1, samples_per_s=1.0), 0.0, None) == [Reason.UNKNOWN_JOB]
    done = job()
    done.status = st.COMPLETED
    assert book.observe(2, rep(1, samples_per_s=1.0), 0.0, done) == [Reason.FINISHED_JOB]
    assert not book.rates


def test_recent_average_adapts_to_a_behaviour_change() -> None:
    book = ProfileBook(ProfileParams(window=5, confirm=2, change_threshold=0.25))
    for i, r in enumerate([10.0, 10.4, 9.6, 10.0, 20.0, 20.0]):
        book.observe(i, rep(1, samples_per_s=r), 0.0, job())
    assert book.measured("j", "") == {1: 20.0}


def test_loss_points_are_bounded() -> None:
    book = ProfileBook(ProfileParams(loss_points=16))
    for k in range(100):
        book.observe(k, rep(1, samples_per_s=1.0, iteration=k, loss=1.0 / (k + 1)), 0.0, job())
    assert len(book.losses["j"]) <= 16
    assert book.losses["j"][-1] == (99, 0.01)


def test_overestimate_until_the_fit_is_trusted() -> None:
    book = ProfileBook(ProfileParams(fit_min_counts=3))
    j = job()

    def speed(w: int) -> float:
        return 1.0 / (0.4 / w + 0.05 + 0.02 * w)

    book.observe(1, rep(4, samples_per_s=speed(4)), 0.0, j)
    first = throughput_update(book, "j", "", j)
    assert first is not None and first.overestimated and first.model_kind == OVERESTIMATE_KIND
    assert first.throughput[8] == pytest.approx(speed(4) * 2)
    for w in (1, 2):
        book.observe(w + 1, rep(w, samples_per_s=speed(w)), 0.0, j)
    fitted = throughput_update(book, "j", "", j)
    assert fitted is not None and fitted.model_kind == MODEL_KIND and not fitted.overestimated
    assert fitted.throughput[8] == pytest.approx(speed(8), rel=1e-6)
    assert fitted.samples == 3


def test_a_fit_that_does_not_explain_the_data_is_not_used() -> None:
    book = ProfileBook(ProfileParams(fit_min_counts=3, fit_max_error=0.10))
    j = job()
    for i, (w, r) in enumerate(((1, 10.0), (2, 2.0), (3, 30.0), (4, 3.0))):
        book.observe(i, rep(w, samples_per_s=r), 0.0, j)
    update = throughput_update(book, "j", "", j)
    assert update is not None and update.model_kind == OVERESTIMATE_KIND and update.overestimated
    assert update.throughput[2] == 2.0 and update.throughput[3] == 30.0


def test_published_counts_are_capped() -> None:
    book = ProfileBook(ProfileParams(publish_max_counts=16))
    j = st.JobState(spec=ev.JobSpec(user="u", max_gpus=5000))
    book.observe(1, ev.ProgressReported(job_id="j", iteration=1, num_gpus=2, samples_per_s=4.0), 0.0, j)
    update = throughput_update(book, "j", "", j)
    assert update is not None and sorted(update.throughput) == list(range(1, 17))


def test_convergence_needs_a_target_and_enough_points() -> None:
    beta = (0.02, 0.5, 0.3)
    book = ProfileBook()
    j = job(convergence_target=0.35)
    for i, k in enumerate(range(0, 1000, 50)):
        loss = 1.0 / (beta[0] * k + beta[1]) + beta[2]
        book.observe(i, rep(1, samples_per_s=1.0, iteration=k, loss=loss), 0.0, j)
    est = convergence_update(book, "j", j)
    assert isinstance(est, ev.ConvergenceEstimated)
    assert est.estimated_total_iterations == pytest.approx((1 / 0.05 - 0.5) / 0.02, abs=1)
    assert convergence_update(book, "j", job(convergence_target=0.2)) is Reason.TARGET_UNREACHABLE
    assert convergence_update(book, "j", job()) is None  # no target, no plateau rule
    assert convergence_update(book, "j", job(total_iterations=10)) is None  # known length


def test_plateau_rule_uses_observed_steps_per_epoch() -> None:
    beta = (0.02, 0.5, 0.3)
    book = ProfileBook(ProfileParams(plateau_delta=0.001))
    j = job()
    for i, k in enumerate(range(0, 1000, 50)):
        loss = 1.0 / (beta[0] * k + beta[1]) + beta[2]
        book.observe(i, rep(1, samples_per_s=1.0, iteration=k, loss=loss, data_epoch=k // 200), 0.0, j)
    assert book.steps_per_epoch("j") == 200.0
    est = convergence_update(book, "j", j)
    assert isinstance(est, ev.ConvergenceEstimated) and est.estimated_total_iterations > 950


def test_forget_drops_a_job() -> None:
    book = ProfileBook()
    book.observe(1, rep(1, samples_per_s=1.0, loss=1.0), 0.0, job())
    book.forget("j")
    assert not book.rates and not book.losses and not book.dirty_models and not book.dirty_convergence


def test_publish_decisions() -> None:
    kw = {"min_interval_s": 30.0, "material_change": 0.05}
    assert publish_decision(now=0.0, last_at=None, change=0.0, flag_changed=False, **kw) == FIRST
    assert publish_decision(now=10.0, last_at=0.0, change=0.01, flag_changed=False, **kw) == UNCHANGED
    assert publish_decision(now=10.0, last_at=0.0, change=0.5, flag_changed=False, **kw) == TOO_SOON
    assert publish_decision(now=30.0, last_at=0.0, change=0.5, flag_changed=False, **kw) == MATERIAL
    assert publish_decision(now=30.0, last_at=0.0, change=0.0, flag_changed=True, **kw) == FLAG
    assert [is_publish(d) for d in (FIRST, FLAG, MATERIAL, TOO_SOON, UNCHANGED)] == [True] * 3 + [False] * 2
    assert next_due([5.0, 1.0], 30.0) == 31.0 and next_due([], 30.0) is None


def test_relative_change() -> None:
    assert relative_change({1: 2.0, 2: 4.0}, {1: 2.0, 2: 5.0}) == pytest.approx(0.25)
    assert relative_change({1: 2.0}, {1: 2.0, 2: 4.0}) == math.inf
    assert relative_change({1: 0.0}, {1: 1.0}) == math.inf
    assert relative_change({}, {}) == 0.0


def test_a_known_profile_gives_the_shape_measurements_give_the_scale() -> None:
    from shoal.profiling import PROFILE_KIND

    book = ProfileBook()
    j = job(profile={"": {1: 10.0, 2: 18.0, 4: 28.0}})
    book.observe(1, rep(2, samples_per_s=9.0), 0.0, j)
    update = throughput_update(book, "j", "K80", j)
    assert update is None  # nothing measured on K80
    update = throughput_update(book, "j", "", j)
    assert update is not None and update.model_kind == PROFILE_KIND and not update.overestimated
    assert update.throughput[2] == 9.0
    assert update.throughput[1] == pytest.approx(5.0) and update.throughput[4] == pytest.approx(14.0)
    assert update.throughput[3] == pytest.approx(11.5)  # the profile interpolated, then scaled

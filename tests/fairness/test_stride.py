"""Gang-aware stride (Algorithm 1) against lottery with backfilling: Table 2."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.fairness.balance import job_tickets, tickets_per_gpu
from shoal.fairness.stride import (
    StrideJob,
    gang_aware_stride,
    gpu_quanta_by_job,
    lottery_with_backfilling,
    new_job_pass,
    stride,
)


def table2_jobs() -> list[StrideJob]:
    """One 4-GPU server; users A, B, C (100 tickets) with two jobs of 1, 2, 4 GPUs."""
    sizes = {"A": 1, "B": 2, "C": 4}
    tpg = tickets_per_gpu(dict.fromkeys(sizes, 100.0), {u: [s, s] for u, s in sizes.items()})
    return [
        StrideJob(job_id=f"{u}{k}", size=s, job_tickets=job_tickets(tpg[u], s))
        for u, s in sizes.items()
        for k in (1, 2)
    ]


def percent_of_quanta(ran: dict[str, int], quanta: int) -> dict[str, float]:
    return {j: 100.0 * n / quanta for j, n in ran.items()}


def test_table2_gang_aware_stride_is_exact_within_six_quanta() -> None:
    jobs = table2_jobs()
    share = percent_of_quanta(gpu_quanta_by_job(jobs, 4, 6), 6)
    assert share == pytest.approx(
        {"A1": 66.7, "A2": 66.7, "B1": 33.3, "B2": 33.3, "C1": 16.7, "C2": 16.7}, abs=0.05
    )
    # Each user gets a third of the server: 1.33 GPUs.
    for user, size in (("A", 1), ("B", 2), ("C", 4)):
        gpu_quanta = sum(gpu_quanta_by_job(jobs, 4, 6)[f"{user}{k}"] * size for k in (1, 2))
        assert gpu_quanta / 6 == pytest.approx(4 / 3)


def test_table2_stride_without_size_is_unfair() -> None:
    # stride ∝ 1/job_tickets (size left out): what REPRODUCTION.md warns about.
    unnormalised = [
        StrideJob(job_id=j.job_id, size=j.size, job_tickets=j.job_tickets * j.size) for j in table2_jobs()
    ]
    ran = gpu_quanta_by_job(unnormalised, 4, 6)
    gpu_quanta = {u: sum(ran[f"{u}{k}"] * s for k in (1, 2)) for u, s in (("A", 1), ("B", 2), ("C", 4))}
    # Users are no longer equal: the 4-GPU user gets far more than the 1-GPU user.
    assert gpu_quanta["C"] >= 2 * gpu_quanta["A"]
    assert len(set(gpu_quanta.values())) > 1


def test_table2_lottery_with_backfilling_is_measurably_unfair() -> None:
    jobs = table2_jobs()
    quanta = 2000
    share = percent_of_quanta(gpu_quanta_by_job(jobs, 4, quanta, lottery_seed=7), quanta)
    # 4-GPU jobs are skipped more often: far below 16.7 %; 1-GPU jobs above 66.7 %.
    assert share["C1"] < 12.0 and share["C2"] < 12.0
    assert share["A1"] > 70.0 and share["A2"] > 70.0
    stride_share = percent_of_quanta(gpu_quanta_by_job(jobs, 4, 6), 6)
    assert abs(stride_share["C1"] - 100 / 6) < abs(share["C1"] - 100 / 6)


def test_skipped_job_keeps_its_pass_and_runs_next_quantum() -> None:
    jobs = [
        StrideJob(job_id="one", size=1, job_tickets=50.0),
        StrideJob(job_id="four", size=4, job_tickets=200.0),
    ]
    first = gang_aware_stride(jobs, 4, {"one": 0.0, "four": 0.001})
    assert first.scheduled == ("one",)
    assert first.passes["four"] == 0.001
    assert first.free_gpus == 3
    second = gang_aware_stride(jobs, 4, first.passes)
    assert second.scheduled == ("four",)


def test_ties_break_by_size_then_arrival_then_id() -> None:
    jobs = [
        StrideJob(job_id="b", size=2, job_tickets=1.0, arrival_s=0.0),
        StrideJob(job_id="a", size=2, job_tickets=1.0, arrival_s=5.0),
        StrideJob(job_id="c", size=1, job_tickets=1.0, arrival_s=9.0),
    ]
    assert gang_aware_stride(jobs, 3, {}).scheduled == ("c", "b")


def test_new_job_starts_at_minimum_pass_and_zero_ticket_job_goes_last() -> None:
    assert new_job_pass([3.0, 1.5, math.inf]) == 1.5
    assert new_job_pass([]) == 0.0
    assert stride(2, 0.0) == math.inf
    jobs = [
        StrideJob(job_id="free", size=1, job_tickets=0.0),
        StrideJob(job_id="paid", size=1, job_tickets=1.0),
    ]
    res = gang_aware_stride(jobs, 1, {"free": 0.0, "paid": 100.0})
    assert res.scheduled == ("paid",)
    assert res.passes["free"] == 0.0


def test_lottery_only_schedules_jobs_that_fit() -> None:
    import random

    jobs = table2_jobs()
    rng = random.Random(1)
    for _ in range(200):
        chosen = lottery_with_backfilling(jobs, 4, rng)
        assert sum(next(j.size for j in jobs if j.job_id == c) for c in chosen) <= 4
        assert len(set(chosen)) == len(chosen)


def _algorithm1(
    jobs: list[StrideJob], num_gpus: int, passes: dict[str, float]
) -> tuple[tuple[str, ...], dict[str, float], int]:
    """Algorithm 1 as the paper states it, with the documented start pass and tie-break."""
    known = [passes[j.job_id] for j in jobs if j.job_id in passes and math.isfinite(passes[j.job_id])]
    start = min(known) if known else 0.0
    current = {j.job_id: passes.get(j.job_id, start) for j in jobs}
    free, scheduled = num_gpus, []
    for job in sorted(
        jobs, key=lambda j: (j.job_tickets <= 0, current[j.job_id], j.size, j.arrival_s, j.job_id)
    ):
        if free <= 0:
            break
        if job.size <= free:
            free -= job.size
            scheduled.append(job.job_id)
            if job.job_tickets > 0:
                current[job.job_id] += job.size / job.job_tickets
    return tuple(scheduled), current, free


@settings(max_examples=400, deadline=None)
@given(
    cases=hs.lists(
        hs.tuples(
            hs.sampled_from([1, 2, 4, 8]),
            hs.sampled_from([0.0, 25.0, 100.0, 400.0]),
            hs.one_of(hs.none(), hs.sampled_from([0.0, 0.5, 3.0, math.inf])),
        ),
        min_size=1,
        max_size=4,
    ),
    num_gpus=hs.integers(min_value=0, max_value=8),
)
def test_gang_aware_stride_matches_algorithm_1_lone_jobs_included(
    cases: list[tuple[int, float, float | None]], num_gpus: int
) -> None:
    # A lone job takes a shortcut past the sort; one to four jobs, with and without
    # passes (infinite ones too), tickets or GPUs, must all agree with Algorithm 1.
    jobs = [
        StrideJob(job_id=f"j{i}", size=s, job_tickets=t, arrival_s=float(i))
        for i, (s, t, _) in enumerate(cases)
    ]
    passes = {f"j{i}": p for i, (_, _, p) in enumerate(cases) if p is not None}
    result = gang_aware_stride(jobs, num_gpus, passes)
    assert (result.scheduled, result.passes, result.free_gpus) == _algorithm1(jobs, num_gpus, passes)

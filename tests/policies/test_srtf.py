"""SRTF, SRSF and the altruistic SRTF-E / SRSF-E (AFS/CoDDL §2.2, §5.5)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from shoal.policies.base import ClusterView, Decision, JobView, check_decision
from shoal.policies.common import arrival_order, request_size
from shoal.policies.srtf import SRSF, SRTF, SRSFElastic, SRTFElastic, peak_size

from tests.policies.checked import run_checked
from tests.policies.test_policy_properties import views

LINEAR = tuple(float(k) for k in range(9))


def job(
    job_id: str, requested: int, remaining: float | None, *, curve: tuple[float, ...] = LINEAR, **kw: object
) -> JobView:
    return JobView(
        job_id=job_id,
        min_gpus=1,
        max_gpus=len(curve) - 1,
        requested_gpus=requested,
        throughput=curve,
        remaining_iterations=remaining,
        **kw,  # type: ignore[arg-type]
    )


def cluster(gpus: int, *jobs: JobView) -> ClusterView:
    return ClusterView(now_s=0.0, total_gpus=gpus, jobs=jobs)


def test_srtf_orders_by_remaining_time_at_the_request_and_backfills() -> None:
    # Remaining time at the request: a 800/4 = 200 s, b 300/1 = 300 s, c 400/1 = 400 s,
    # d 3000/4 = 750 s.
    a = job("a", 4, 800.0)
    b = job("b", 1, 300.0)
    c = job("c", 1, 400.0)
    d = job("d", 4, 3000.0)
    # 6 GPUs: a (4), b (1), c (1); d does not fit.
    assert SRTF().decide(cluster(6, a, b, c, d), {}).shares == {"a": 4, "b": 1, "c": 1}
    # 5 GPUs: a (4) and b (1) fill the cluster; c waits.
    assert SRTF().decide(cluster(5, a, b, c, d), {}).shares == {"a": 4, "b": 1}
    # 3 GPUs: a does not fit, the scan goes on past it (backfill).
    assert SRTF().decide(cluster(3, a, b, c, d), {}).shares == {"b": 1, "c": 1}


def test_srtf_preempts_for_a_shorter_newcomer() -> None:
    running = job("old", 2, 1000.0, current_gpus=2)
    newcomer = job("new", 2, 10.0)
    assert SRTF().decide(cluster(2, running, newcomer), {}).shares == {"new": 2}


def test_srsf_penalises_wide_jobs() -> None:
    # Time: wide 400/4 = 100 s, narrow 150/1 = 150 s; service: wide 400, narrow 150.
    wide = job("wide", 4, 400.0)
    narrow = job("narrow", 1, 150.0)
    assert SRTF().decide(cluster(4, wide, narrow), {}).shares == {"wide": 4}
    assert SRSF().decide(cluster(4, wide, narrow), {}).shares == {"narrow": 1}


def test_unknown_lengths_rank_last() -> None:
    known = job("known", 2, 1e9)
    unknown = job("unknown", 2, None)
    assert SRTF().decide(cluster(2, unknown, known), {}).shares == {"known": 2}


def test_elastic_versions_give_leftovers_to_the_largest_normalised_gain() -> None:
    # a: speedup 1, 1.9, 2.7; b: 1, 1.2, 1.3 (normalised by p(1)).
    a = job("a", 1, 100.0, curve=(0.0, 10.0, 19.0, 27.0))
    b = job("b", 1, 50.0, curve=(0.0, 1.0, 1.2, 1.3))
    plain = SRTF().decide(cluster(4, a, b), {})
    assert plain.shares == {"a": 1, "b": 1}
    # Leftover 2 GPUs: a's steps gain 0.9 then 0.8 per GPU, b's 0.2: both to a.
    assert SRTFElastic().decide(cluster(4, a, b), {}).shares == {"a": 3, "b": 1}
    assert SRSFElastic().decide(cluster(4, a, b), {}).shares == {"a": 3, "b": 1}


def test_elastic_versions_do_not_start_waiting_jobs_below_their_request() -> None:
    a = job("a", 2, 100.0)
    wide = job("wide", 4, 200.0)
    # 3 GPUs: a gets 2; wide (4) cannot start; the leftover GPU grows a.
    assert SRTFElastic().decide(cluster(3, a, wide), {}).shares == {"a": 3}


def test_non_elastic_jobs_do_not_grow() -> None:
    a = job("a", 2, 100.0, elastic=False)
    assert SRTFElastic().decide(cluster(8, a), {}).shares == {"a": 2}


@settings(max_examples=80, deadline=None)
@given(view=views())
def test_non_elastic_versions_give_the_request_or_nothing(view: ClusterView) -> None:
    for policy in (SRTF(), SRSF()):
        decision = policy.decide(view, {})
        check_decision(view, decision)
        by_id = {j.job_id: j for j in view.jobs}
        for job_id, gpus in decision.shares.items():
            assert gpus == request_size(by_id[job_id])
    relaxed = SRTF(use_max_gpus=True).decide(view, {})
    check_decision(view, relaxed)
    by_id = {j.job_id: j for j in view.jobs}
    assert all(g == peak_size(by_id[j]) for j, g in relaxed.shares.items())


@settings(max_examples=80, deadline=None)
@given(view=views())
def test_elastic_versions_schedule_the_same_jobs_with_at_least_the_request(view: ClusterView) -> None:
    for plain, elastic in ((SRTF(), SRTFElastic()), (SRSF(), SRSFElastic())):
        base = plain.decide(view, {}).shares
        more = elastic.decide(view, {})
        check_decision(view, more)
        assert set(more.shares) == set(base)
        assert all(more.shares[j] >= base[j] for j in base)


def test_figure_6_variant_sizes_jobs_at_their_peak_throughput() -> None:
    # Peak at 3 GPUs (the curve falls after it); the request is 1.
    a = job("a", 1, 300.0, curve=(0.0, 1.0, 1.8, 2.4, 2.2))
    b = job("b", 1, 100.0, curve=(0.0, 1.0, 2.0))
    assert SRTF().decide(cluster(4, a, b), {}).shares == {"a": 1, "b": 1}
    # Relaxed: b (100/2 = 50 s at 2 GPUs) first, then a needs 3 of the 2 left: skipped.
    assert SRTF(use_max_gpus=True).decide(cluster(4, a, b), {}).shares == {"b": 2}
    assert SRTF(use_max_gpus=True).decide(cluster(5, a, b), {}).shares == {"a": 3, "b": 2}


def _every_job_ranked(policy: Any, view: ClusterView) -> Decision:
    """The decision as first written: every job ranked at every decision, by
    ``(priority, arrival rank, size)``, and the leftovers offered over every job."""
    jobs = arrival_order(view.jobs)
    ranked = []
    for rank, j in enumerate(jobs):
        size = peak_size(j) if policy.use_max_gpus else request_size(j)
        if size > 0:
            ranked.append((policy._priority(j, size), rank, size))
    ranked.sort()
    free = view.total_gpus
    shares: dict[str, int] = {}
    for _, rank, size in ranked:
        if size <= free:
            shares[jobs[rank].job_id] = size
            free -= size
    if policy.altruistic and free > 0:
        policy._distribute_leftover(jobs, shares, free)
    return Decision(shares=shares)


@pytest.mark.parametrize("make", [SRTF, SRSF, SRTFElastic, SRSFElastic, lambda: SRTF(use_max_gpus=True)])
def test_keeping_the_ranking_between_decisions_changes_no_decision(make: Callable[[], Any]) -> None:
    """6214e9's first jobs queue up behind long runners (hundreds wait at each decision)
    on the 16 x 4 topology; 2869ce on a flat pool."""
    for trace, flat in (("philly:6214e9:300", False), ("philly:2869ce:150", True)):
        kept = make()

        def against_every_job_ranked(
            v: ClusterView, memory: Mapping[str, Any], d: Decision, kept: Any = kept
        ) -> None:
            ref = _every_job_ranked(kept, v)
            assert d == ref and list(d.shares.items()) == list(ref.shares.items())

        policy = run_checked(kept, against_every_job_ranked, trace, flat)
        assert policy.decisions > 100 and policy.started > 50


@settings(max_examples=100, deadline=None)
@given(views())
def test_any_view_ranked_afresh_decides_as_every_job_ranked(view: ClusterView) -> None:
    for policy in (SRTF(), SRSF(), SRTFElastic(), SRSFElastic(), SRTF(use_max_gpus=True)):
        d = policy.decide(view, {})
        ref = _every_job_ranked(policy, view)
        assert d == ref and list(d.shares.items()) == list(ref.shares.items())


def test_a_failed_decision_leaves_no_ranking_to_take() -> None:
    """A decision that fails while ranking the rebuilt views (here a key that raises once)
    leaves the kept ranking half brought up to date: the next decision ranks every job."""
    from shoal.policies.base import LiveJobs

    a, b = job("a", 1, 100.0, arrival_s=0.0), job("b", 1, 50.0, arrival_s=1.0)
    policy = SRTF()
    first = ClusterView(
        now_s=0.0, total_gpus=1, jobs=LiveJobs({"a": a, "b": b}, serial=1), arrival_ordered=True
    )
    assert policy.decide(first, {}).shares == {"b": 1}
    b2 = msgspec.structs.replace(b, remaining_iterations=10.0, current_gpus=1)
    table = {"a": a, "b": b2}
    second = ClusterView(
        now_s=10.0,
        total_gpus=1,
        jobs=LiveJobs(table, serial=2, after=1, rebuilt=("b",), left=()),
        arrival_ordered=True,
    )
    real = policy._priority
    policy._priority = lambda j, size: (_ for _ in ()).throw(RuntimeError("once"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        policy.decide(second, {})
    policy._priority = real  # type: ignore[method-assign]
    third = ClusterView(
        now_s=10.0,
        total_gpus=1,
        jobs=LiveJobs(table, serial=3, after=2, rebuilt=(), left=()),
        arrival_ordered=True,
    )
    assert policy.decide(third, {}) == _every_job_ranked(policy, third) == Decision(shares={"b": 1})

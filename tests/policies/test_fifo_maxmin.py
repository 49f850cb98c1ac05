"""FIFO with requested GPUs and elastic Max-Min."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.policies.base import ClusterView, JobView, check_decision
from shoal.policies.fifo import FIFO
from shoal.policies.maxmin import MaxMin

from tests.policies.test_policy_properties import later, views

LINEAR = tuple(float(k) for k in range(9))


def job(
    job_id: str, requested: int = 1, *, arrival: float = 0.0, curve: tuple[float, ...] = LINEAR, **kw: object
) -> JobView:
    return JobView(
        job_id=job_id,
        arrival_s=arrival,
        min_gpus=1,
        max_gpus=len(curve) - 1,
        requested_gpus=requested,
        throughput=curve,
        **kw,  # type: ignore[arg-type]
    )


def cluster(gpus: int, *jobs: JobView) -> ClusterView:
    return ClusterView(now_s=0.0, total_gpus=gpus, jobs=jobs)


# -- FIFO ---------------------------------------------------------------------------------


def test_fifo_serves_in_arrival_order_with_backfill() -> None:
    a = job("a", 2, arrival=0.0)
    big = job("big", 4, arrival=1.0)
    small = job("small", 1, arrival=2.0)
    assert FIFO().decide(cluster(4, small, big, a), {}).shares == {"a": 2, "small": 1}
    # Head-of-line blocking: nothing behind the first misfit starts.
    assert FIFO(backfill=False).decide(cluster(4, small, big, a), {}).shares == {"a": 2}


def test_fifo_never_preempts_a_running_job() -> None:
    late_runner = job("late", 3, arrival=10.0, current_gpus=3)
    early = job("early", 2, arrival=0.0)
    assert FIFO().decide(cluster(4, early, late_runner), {}).shares == {"late": 3}


def test_fifo_stops_the_youngest_runners_when_the_cluster_shrinks() -> None:
    old = job("old", 2, arrival=0.0, current_gpus=2)
    young = job("young", 2, arrival=5.0, current_gpus=2)
    assert FIFO().decide(cluster(3, young, old), {}).shares == {"old": 2}


@settings(max_examples=80, deadline=None)
@given(view=views())
def test_fifo_keeps_every_job_it_started(view: ClusterView) -> None:
    first = FIFO().decide(view, {})
    check_decision(view, first)
    nxt = later(view, first, 60.0)
    second = FIFO().decide(nxt, {})
    for job_id, gpus in first.shares.items():
        assert second.shares.get(job_id) == gpus


@settings(max_examples=150, deadline=None)
@given(view=views(max_jobs=16, max_gpus=12), backfill=hs.booleans(), ordered=hs.booleans())
def test_fifo_walking_the_queue_while_gpus_are_free_decides_as_walking_it_all(
    view: ClusterView, backfill: bool, ordered: bool
) -> None:
    """decide (running jobs by one pass, the queue walked only while GPUs are free)
    equals decide_all (the literal two passes), shares and their order, over a few
    rounds; on a view that says it is in arrival order too."""
    if ordered:
        jobs = tuple(sorted(view.jobs, key=lambda j: (j.arrival_s, j.job_id)))
        view = msgspec.structs.replace(view, jobs=jobs, arrival_ordered=True)
    policy = FIFO(backfill=backfill)
    for _ in range(3):
        fast = policy.decide(view, {})
        slow = policy.decide_all(view, {})
        assert list(fast.shares.items()) == list(slow.shares.items())
        view = later(view, fast, 60.0)


# -- Max-Min -------------------------------------------------------------------------------


def test_max_min_levels_gpu_counts() -> None:
    jobs = [job(f"j{i}", arrival=float(i)) for i in range(3)]
    # 8 GPUs over 3 jobs: 3, 3, 2 (the remainder to the earliest arrivals).
    assert MaxMin().decide(cluster(8, *jobs), {}).shares == {"j0": 3, "j1": 3, "j2": 2}


def test_max_min_caps_a_job_at_what_it_can_use() -> None:
    small = job("small", curve=(0.0, 1.0, 1.5))  # max_gpus 2
    flat = job("flat", curve=(0.0, 1.0, 1.8, 1.8, 1.8))  # gains nothing past 2
    big = job("big")
    assert MaxMin().decide(cluster(12, small, flat, big), {}).shares == {"small": 2, "flat": 2, "big": 8}


def test_max_min_respects_allowed_counts_and_non_elastic_jobs() -> None:
    powers = job("powers", allowed_gpu_counts=(1, 2, 4, 8))
    rigid = job("rigid", 3, elastic=False)
    decision = MaxMin().decide(cluster(8, powers, rigid), {})
    check_decision(cluster(8, powers, rigid), decision)
    # rigid takes its 3 first (fewest GPUs: 0), powers 1 -> 2 -> 4; 1 GPU stays idle
    # (powers' next step is 8).
    assert decision.shares == {"powers": 4, "rigid": 3}


@settings(max_examples=80, deadline=None)
@given(view=views())
def test_max_min_leaves_no_useful_step_that_fits(view: ClusterView) -> None:
    """Water-filling ends only when no job's next useful step fits in the idle GPUs."""
    from shoal.policies.common import Ladder, throughput_at

    decision = MaxMin().decide(view, {})
    check_decision(view, decision)
    free = view.total_gpus - sum(decision.shares.values())
    for j in view.jobs:
        have = decision.shares.get(j.job_id, 0)
        nxt = Ladder(j).next_count(have)
        useful = nxt and (have == 0 or throughput_at(j, nxt) > throughput_at(j, have))
        if useful:
            assert nxt - have > free  # otherwise it would have been given


def _water_filling(view: ClusterView) -> dict[str, int]:
    """The plain form: one heap of (share, arrival rank) over every job from 0 GPUs."""
    import heapq

    from shoal.policies.common import Ladder, arrival_order, throughput_at

    jobs = arrival_order(view.jobs)
    counts = [0] * len(jobs)
    heap = [(0, rank) for rank in range(len(jobs))]
    free = view.total_gpus
    while heap and free > 0:
        count, rank = heapq.heappop(heap)
        nxt = Ladder(jobs[rank]).next_count(count)
        if nxt == 0 or nxt - count > free:
            continue
        if count > 0 and throughput_at(jobs[rank], nxt) <= throughput_at(jobs[rank], count):
            continue
        counts[rank] = nxt
        free -= nxt - count
        heapq.heappush(heap, (nxt, rank))
    return {j.job_id: c for j, c in zip(jobs, counts, strict=True) if c}


@settings(max_examples=300, deadline=None)
@given(view=views(max_jobs=30, max_gpus=24))
def test_max_min_equals_plain_water_filling(view: ClusterView) -> None:
    """Max-Min's first round in arrival order (only as far as GPUs last) gives what a
    heap over every job gives, in the same order."""
    shares = MaxMin().decide(view, {}).shares
    assert list(shares.items()) == list(_water_filling(view).items())


# -- the decision check -----------------------------------------------------------------


def test_check_decision_names_the_first_share_at_fault_in_the_decisions_order() -> None:
    import pytest
    from shoal.policies.base import Decision, DecisionError

    view = cluster(8, job("a", 2), job("rigid", 2, elastic=False), job("c", 1, allowed_gpu_counts=(1, 2, 4)))
    check_decision(view, Decision(shares={"a": 3, "rigid": 2, "c": 2}))  # all feasible
    check_decision(view, Decision(shares={"a": 0, "rigid": 2, "c": 0}))  # zeros are no share
    cases = {
        "share for unknown job 'ghost'": {"a": 1, "ghost": 1},
        "negative share -1 for 'a'": {"a": -1, "ghost": 1},  # the first at fault, in order
        "'rigid' given 3 GPUs, feasible (2,)": {"a": 1, "rigid": 3},
        "'c' given 3 GPUs, feasible (1, 2, 4)": {"c": 3, "a": 0},
        "gave out 9 GPUs of 8": {"a": 8, "c": 1},
    }
    for message, shares in cases.items():
        with pytest.raises(DecisionError) as raised:
            check_decision(view, Decision(shares=shares))
        assert str(raised.value) == message

"""Properties every registered policy must keep, on random cluster views.

For each policy that imports (others are being written concurrently and are skipped
until they exist): the decision is feasible for every job and within capacity
(:func:`~shoal.policies.base.check_decision`), deterministic (same view and memory, same
decision), and its memory survives a msgpack round trip (the allocator stores it in
``SharesDecided``) giving the same next decision.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from shoal.policies.base import ClusterView, Decision, JobView, check_decision
from shoal.policies.registry import PolicyImportError, get_policy, policy_names

USERS = ("alice", "bob", "carol")


@hs.composite
def curves(draw: hs.DrawFn, length: int, *, sane: bool = True) -> tuple[float, ...]:
    """A throughput curve of ``length`` points (index 0 is 0.0).

    ``sane``: positive integer increments (gains at least 1/400, no flat steps except when
    drawn as 0), which keeps eq. (3) and the fractional gain away from float rounding.
    Otherwise steps may be flat or negative.
    """
    low = 0 if sane else -20
    base = draw(hs.integers(1, 40))
    incs = draw(hs.lists(hs.integers(low, 40), min_size=length - 2, max_size=length - 2))
    values = [0.0, float(base)]
    for inc in incs:
        values.append(max(1.0, values[-1] + inc) if not sane else values[-1] + inc)
    return tuple(values[:length])


@hs.composite
def jobs(draw: hs.DrawFn, index: int, *, sane: bool = True) -> JobView:
    elastic = draw(hs.booleans()) if draw(hs.integers(0, 3)) == 0 else True
    min_gpus = draw(hs.sampled_from((1, 1, 1, 2, 3)))
    max_gpus = draw(hs.integers(min_gpus, 8))
    requested = draw(hs.integers(1, 8))
    allowed = draw(hs.sampled_from((None, None, (1, 2, 4, 8), (2, 4), (3,), (1, 3, 5))))
    length = max(max_gpus, requested) + 1
    curve = draw(curves(length, sane=sane))
    remaining = draw(hs.sampled_from((None, 0.0, 100.0, 100.0, 250.0, 1000.0, 5000.0)))
    return JobView(
        job_id=f"j{index:02d}",
        user=draw(hs.sampled_from(USERS)),
        arrival_s=float(draw(hs.sampled_from((0, 0, 10, 20, 30)))),
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        requested_gpus=requested,
        elastic=elastic,
        allowed_gpu_counts=allowed,
        throughput=curve,
        remaining_iterations=remaining,
        total_iterations=None if remaining is None else remaining + 10.0,
        attained_service_gpu_s=float(draw(hs.integers(0, 10_000))),
        current_gpus=draw(hs.integers(0, 4)),
    )


@hs.composite
def views(draw: hs.DrawFn, *, max_jobs: int = 12, max_gpus: int = 24, sane: bool = True) -> ClusterView:
    """A random flat-pool view: up to ``max_jobs`` jobs and ``max_gpus`` GPUs."""
    n = draw(hs.integers(0, max_jobs))
    return ClusterView(
        now_s=float(draw(hs.integers(0, 100_000))),
        total_gpus=draw(hs.integers(0, max_gpus)),
        jobs=tuple(draw(jobs(i, sane=sane)) for i in range(n)),
        user_tickets={u: 100.0 for u in USERS},
    )


def later(view: ClusterView, decision: Decision, dt: float) -> ClusterView:
    """The view ``dt`` seconds on, with the decided shares running."""
    moved = tuple(
        msgspec.structs.replace(j, current_gpus=decision.shares.get(j.job_id, 0)) for j in view.jobs
    )
    return msgspec.structs.replace(view, now_s=view.now_s + dt, jobs=moved)


def _loadable() -> list[str]:
    names = []
    for name in policy_names():
        try:
            get_policy(name)
        except PolicyImportError:
            continue
        names.append(name)
    return names


LOADABLE = _loadable()
OWN = ("afs-l", "afs-l-naive", "afs-p", "afs-p-naive", "srtf", "srsf", "srtf-e", "srsf-e", "fifo", "max-min")


def test_own_policies_are_all_loadable() -> None:
    assert set(OWN) <= set(LOADABLE)


def _roundtrip(memory: dict[str, Any]) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(memory))


@pytest.mark.parametrize("name", LOADABLE)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=views(sane=False), dt=hs.sampled_from((1.0, 600.0, 7200.0, 20_000.0)))
def test_feasible_deterministic_and_replayable(name: str, view: ClusterView, dt: float) -> None:
    policy = get_policy(name)
    first = policy.decide(view, {})
    check_decision(view, first)
    assert sum(first.shares.values()) <= view.total_gpus
    # Deterministic: a fresh instance on the same view and memory decides the same.
    assert get_policy(name).decide(view, {}) == first
    # Memory is plain msgpack data and replays to the same next decision.
    memory = _roundtrip(dict(first.memory))
    assert memory == dict(first.memory)
    nxt_view = later(view, first, dt)
    live = policy.decide(nxt_view, first.memory)
    replayed = get_policy(name).decide(nxt_view, memory)
    check_decision(nxt_view, live)
    assert live.shares == replayed.shares
    assert live.gpu_types == replayed.gpu_types
    assert _roundtrip(dict(live.memory)) == _roundtrip(dict(replayed.memory))
    wake = live.memory.get("next_decision_at_s")
    if wake is not None:
        assert math.isfinite(wake) and wake > nxt_view.now_s


LENGTH_UNAWARE = ("afs-p", "afs-p-naive", "max-min", "fifo")


@pytest.mark.parametrize("name", LENGTH_UNAWARE)
@settings(max_examples=40, deadline=None)
@given(view=views())
def test_length_unaware_policies_ignore_lengths(name: str, view: ClusterView) -> None:
    hidden = msgspec.structs.replace(
        view,
        jobs=tuple(
            msgspec.structs.replace(j, remaining_iterations=None, total_iterations=None) for j in view.jobs
        ),
    )
    policy = get_policy(name)
    assert policy.decide(view, {}) == policy.decide(hidden, {})


ELASTIC_WORK_CONSERVING = ("afs-l", "afs-p", "max-min")


@pytest.mark.parametrize("name", ELASTIC_WORK_CONSERVING)
@settings(max_examples=40, deadline=None)
@given(view=views())
def test_no_gpu_left_idle_that_a_job_could_use(name: str, view: ClusterView) -> None:
    """Elastic policies leave a GPU idle only when no job's next step fits and gains."""
    from shoal.policies.common import Ladder, throughput_at

    decision = get_policy(name).decide(view, {})
    free = view.total_gpus - sum(decision.shares.values())
    for job in view.jobs:
        have = decision.shares.get(job.job_id, 0)
        nxt = Ladder(job).next_count(have)
        if nxt and nxt - have <= free:
            # Only a step that gains throughput (or a first share) would be taken.
            assert have > 0 and throughput_at(job, nxt) <= throughput_at(job, have)


@settings(max_examples=200, deadline=None)
@given(job=jobs(0, sane=False))
def test_ladder_steps_through_exactly_the_feasible_counts(job: JobView) -> None:
    from shoal.policies.base import feasible_counts
    from shoal.policies.common import Ladder, request_size

    ladder = Ladder(job)
    steps = []
    count = ladder.first()
    while count:
        steps.append(count)
        count = ladder.next_count(count)
    assert tuple(steps) == feasible_counts(job)
    size = request_size(job)
    assert size == 0 if not steps else size in steps

"""Elastic-Tiresias: compaction admits queued jobs by shrinking, expansion fills idle GPUs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.policies.base import ClusterView, Decision, JobView
from shoal.policies.elastic_tiresias import ElasticTiresias
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import load_workload

from tests.policies.checked import run_checked
from tests.policies.test_tiresias import (
    LengthTripwire,
    assert_pure,
    job,
    kept_next_view,
    next_view,
    queued_views,
    view,
    views,
)

# Sub-linear curve: 8 GPUs give a speedup of 4 (efficiency 0.5), 4 GPUs 3.
SUBLINEAR = (0.0, 1.0, 1.8, 2.4, 3.0, 3.3, 3.6, 3.8, 4.0)


def big_running(queue_service: float) -> JobView:
    return job(
        "big",
        arrival_s=0.0,
        requested_gpus=8,
        max_gpus=8,
        throughput=SUBLINEAR,
        current_gpus=8,
        attained_service_gpu_s=queue_service,
    )


def waiting(n: int, gpus: int = 4) -> list[JobView]:
    # Demoted to G2 by earlier service, so the Tiresias plan alone never preempts big for them.
    return [
        job(f"w{i}", arrival_s=10.0 + i, requested_gpus=gpus, max_gpus=gpus, attained_service_gpu_s=20_000.0)
        for i in range(n)
    ]


def test_compaction_admits_a_queued_job_by_shrinking() -> None:
    # big is in G1 (service past 500 GPU-s). With N = 0, one waiting job triggers compaction:
    # big goes 8 -> 4 GPUs (loses 1 GPU-equivalent of speedup), w0 gains 4 on 4 GPUs.
    policy = ElasticTiresias(compaction_threshold=0)
    d = policy.decide(view(100.0, 8, big_running(1000.0), *waiting(1)), {})
    assert d.shares == {"big": 4, "w0": 4}


def test_compaction_needs_more_than_n_waiting_jobs() -> None:
    policy = ElasticTiresias()  # N = 10
    d = policy.decide(view(100.0, 8, big_running(1000.0), *waiting(10)), {})
    assert d.shares == {"big": 8}
    d = policy.decide(view(100.0, 8, big_running(1000.0), *waiting(11)), {})
    assert d.shares == {"big": 4, "w0": 4}


def test_top_group_jobs_are_never_shrunk() -> None:
    policy = ElasticTiresias(compaction_threshold=0)
    d = policy.decide(view(100.0, 8, big_running(100.0), *waiting(3)), {})
    assert d.shares == {"big": 8}


def test_qos_ratio_bounds_the_shrink() -> None:
    # r = 0.5 keeps big at 4 GPUs or more: 2 waiting 3-GPU jobs cannot both come in.
    policy = ElasticTiresias(compaction_threshold=0)
    d = policy.decide(view(100.0, 8, big_running(1000.0), *waiting(2, gpus=3)), {})
    assert d.shares["big"] >= 4
    assert sum(d.shares.values()) <= 8
    assert d.shares.get("w0") == 3 and "w1" not in d.shares


def test_no_compaction_when_it_loses_efficiency() -> None:
    # The waiting job scales badly (4 GPUs = 0.9× one GPU); shrinking big 8 -> 4 loses 1.0.
    poor = job(
        "poor",
        arrival_s=5.0,
        requested_gpus=4,
        max_gpus=4,
        throughput=(0.0, 1.0, 1.02, 1.04, 0.9),
        attained_service_gpu_s=20_000.0,
    )
    d = ElasticTiresias(compaction_threshold=0).decide(view(100.0, 8, big_running(1000.0), poor), {})
    assert d.shares == {"big": 8}


def test_expansion_gives_idle_gpus_to_the_largest_relative_gain() -> None:
    linear = job("lin", arrival_s=0.0, requested_gpus=2, max_gpus=4, current_gpus=2)
    flat = job(
        "flat",
        arrival_s=1.0,
        requested_gpus=2,
        max_gpus=4,
        throughput=(0.0, 1.0, 1.9, 2.0, 2.05),
        current_gpus=2,
    )
    d = ElasticTiresias().decide(view(50.0, 6, linear, flat), {})
    assert d.shares == {"lin": 4, "flat": 2}
    # The expanded job keeps its size on the next decision, and gives it back for a new job.
    again = ElasticTiresias().decide(
        view(60.0, 6, job("lin", arrival_s=0.0, requested_gpus=2, max_gpus=4, current_gpus=4), flat), d.memory
    )
    assert again.shares == {"lin": 4, "flat": 2}
    newcomer = job("new", arrival_s=55.0, requested_gpus=2, max_gpus=2)
    lin4 = job(
        "lin", arrival_s=0.0, requested_gpus=2, max_gpus=4, current_gpus=4, attained_service_gpu_s=10_000.0
    )
    d = ElasticTiresias().decide(view(60.0, 6, lin4, flat, newcomer), d.memory)
    assert d.shares == {"lin": 2, "flat": 2, "new": 2}


def test_lent_gpus_come_back_before_a_job_of_lower_priority_waits() -> None:
    # a was expanded to 4 while idle; b (same group, later) arrives: a goes back to 2.
    a = job("a", arrival_s=0.0, requested_gpus=2, max_gpus=4, current_gpus=4)
    b = job("b", arrival_s=1.0, requested_gpus=2, max_gpus=4)
    assert ElasticTiresias().decide(view(5.0, 4, a, b), {}).shares == {"a": 2, "b": 2}
    # A compacted job keeps its smaller size while others run.
    shrunk = job("s", arrival_s=0.0, requested_gpus=4, max_gpus=4, current_gpus=2)
    other = job("o", arrival_s=1.0, requested_gpus=2, max_gpus=2, current_gpus=2)
    assert ElasticTiresias().decide(view(5.0, 4, shrunk, other), {}).shares == {"s": 2, "o": 2}


def test_a_job_that_can_never_fit_does_not_block_expansion() -> None:
    small = job("small", arrival_s=0.0, requested_gpus=1, max_gpus=4, current_gpus=1)
    huge = job("huge", arrival_s=1.0, requested_gpus=8, max_gpus=8, elastic=False)
    assert ElasticTiresias().decide(view(5.0, 4, small, huge), {}).shares == {"small": 4}


def test_inelastic_jobs_are_not_resized() -> None:
    rigid = job("rigid", arrival_s=0.0, requested_gpus=2, max_gpus=8, elastic=False, current_gpus=2)
    d = ElasticTiresias().decide(view(50.0, 8, rigid), {})
    assert d.shares == {"rigid": 2}


def test_never_reads_job_lengths() -> None:
    jobs = [
        LengthTripwire(
            job_id=f"j{i}",
            requested_gpus=2,
            max_gpus=4,
            arrival_s=float(i),
            throughput=(0.0, 1.0, 1.8, 2.5, 3.0),
        )
        for i in range(3)
    ]
    d = ElasticTiresias(compaction_threshold=0).decide(
        ClusterView(now_s=5.0, total_gpus=5, jobs=tuple(jobs)), {}
    )
    assert d.shares == {"j0": 2, "j1": 2}
    d = ElasticTiresias().decide(ClusterView(now_s=5.0, total_gpus=9, jobs=tuple(jobs)), {})
    assert sum(d.shares.values()) == 9  # expansion of the idle GPUs


@settings(max_examples=60, deadline=None)
@given(views())
def test_properties(v: ClusterView) -> None:
    assert_pure(ElasticTiresias(compaction_threshold=1), v)
    assert_pure(ElasticTiresias(), v)


def test_runs_a_philly_prefix_to_completion() -> None:
    workload = load_workload("philly:2869ce:150", seed=0)
    summary = Simulator(workload, ElasticTiresias(), SimConfig(flat=True)).run().summary
    assert summary["completed"] == summary["jobs"] == 150
    assert summary["reconfigurations"] > 0  # compaction/expansion resized jobs


def test_starvation_promotion_is_off_by_default_and_works_when_set() -> None:
    """EDL §5.1: a job not scheduled for a long time goes back to G0. Off by default
    (the Tiresias simulator's dlas-gpu, which EDL §6.3 ran on, has it off); with a
    knob of 2, a G1 job that has waited twice its run time goes to the back of G0 (as
    the Tiresias simulator appends it), ahead of every G1 job: here of a G1 job ahead of
    it in G1 that held the GPU."""
    starved = job("s", arrival_s=0.0, requested_gpus=1, max_gpus=1, attained_service_gpu_s=600.0)
    runner = job(
        "r", arrival_s=50.0, requested_gpus=1, max_gpus=1, attained_service_gpu_s=700.0, current_gpus=1
    )
    # s attained 600 GPU-s (past G0's 500, so in G1) and was preempted at t = 300; the knob
    # compares its wait since then with that service (as shoal.policies.tiresias does).
    # Records: [base, first start, preempted at, group, place in the group's list].
    memory = {"jobs": {"s": [0.0, 0.0, 300.0, 1.0, 1.0], "r": [0.0, 50.0, -1.0, 1.0, 0.0]}}
    at = 300.0 + 2 * 600.0
    assert ElasticTiresias().decide(view(at, 1, starved, runner), memory).shares == {"r": 1}
    promoting = ElasticTiresias(promote_knob=2.0)
    assert promoting.decide(view(at - 1.0, 1, starved, runner), memory).shares == {"r": 1}
    assert promoting.decide(view(at, 1, starved, runner), memory).shares == {"s": 1}
    # A G0 job keeps the GPU: the promoted job waits behind it, at the back of G0.
    young = msgspec.structs.replace(runner, attained_service_gpu_s=10.0)
    memory["jobs"]["r"][3] = 0.0
    assert promoting.decide(view(at, 1, starved, young), memory).shares == {"r": 1}


_KW = hs.fixed_dictionaries(
    {
        "queue_thresholds_gpu_s": hs.sampled_from([(500.0, 10_000.0), (300.0,), (180_000.0,)]),
        "compaction_threshold": hs.sampled_from([0, 1, 3, 10]),
        "qos_ratio": hs.sampled_from([0.0, 0.5, 1.0]),
        "service_since_restart": hs.booleans(),
    }
)


def _same(a: Decision, b: Decision) -> None:
    """Equal decisions, the memory's entries in the same order (the log's digest reads it)."""
    assert a == b
    assert list(a.shares.items()) == list(b.shares.items())
    assert list(a.memory["jobs"].items()) == list(b.memory["jobs"].items())


@settings(max_examples=200, deadline=None)
@given(queued_views(), _KW)
def test_the_lazy_queue_walk_decides_as_a_record_for_every_job(
    case: tuple[ClusterView, dict[str, Any]], kw: dict[str, Any]
) -> None:
    """decide (the jobs that never ran walked lazily, the plan stopped where no GPU is
    free, the waiting jobs counted up to N + 1) equals decide_all, over a few rounds."""
    v, memory = case
    policy = ElasticTiresias(**kw)
    for _ in range(3):
        lazy = policy.decide(v, memory)
        _same(lazy, ElasticTiresias(**kw).decide_all(v, memory))
        memory = lazy.memory
        v = next_view(v, lazy, 400.0)


@settings(max_examples=150, deadline=None)
@given(queued_views(), _KW, hs.lists(hs.integers(0, 4), min_size=3, max_size=6))
def test_carried_records_change_no_decision(
    case: tuple[ClusterView, dict[str, Any]], kw: dict[str, Any], steps: list[int]
) -> None:
    """Records carried over between decisions decide as records read from memory. Each
    round hands the policy its own memory, an equal copy (decoded from msgpack), or a
    changed one (a record's base moved: the carried records must not be taken), over views
    that keep unchanged jobs' objects, with completions and arrivals."""
    v, memory = case
    carried = ElasticTiresias(**kw)
    for step in steps:
        d = carried.decide(v, memory)
        _same(d, ElasticTiresias(**kw).decide_all(v, memory))
        memory = d.memory
        if step == 1:
            memory = msgspec.msgpack.decode(msgspec.msgpack.encode(memory))
        elif step == 2 and memory["jobs"]:
            first = next(iter(memory["jobs"]))
            entry = list(memory["jobs"][first])
            entry[0] += 50.0
            memory = {**memory, "jobs": {**memory["jobs"], first: entry}}
        v = kept_next_view(v, d, 400.0, step)


def test_the_simulators_decisions_are_those_of_a_record_for_every_job() -> None:
    """6214e9's first jobs queue up behind long runners (hundreds wait, compaction runs)
    on the 16 x 4 topology; 2869ce on a flat pool (expansion too)."""

    def against_every_record(v: ClusterView, memory: Mapping[str, Any], d: Decision) -> None:
        _same(d, ElasticTiresias().decide_all(v, memory))

    for trace, flat in (("philly:6214e9:300", False), ("philly:2869ce:150", True)):
        policy = run_checked(ElasticTiresias(), against_every_record, trace, flat)
        assert policy.decisions > 100 and policy.resized > 10


def test_a_rebuilt_job_with_service_and_no_record_is_looked_at() -> None:
    """With the simulator's jobs, only the views rebuilt since the last decision are looked
    at for service or GPUs without a record. A job that never ran here but shows service
    (it ran elsewhere) is demoted as decide_all demotes it, and recorded."""
    from shoal.policies.base import LiveJobs

    a = job("a", arrival_s=0.0, requested_gpus=1, max_gpus=1)
    b = job("b", arrival_s=1.0, requested_gpus=1, max_gpus=1)
    policy = ElasticTiresias()
    first = ClusterView(
        now_s=0.0, total_gpus=1, jobs=LiveJobs({"a": a, "b": b}, serial=1), arrival_ordered=True
    )
    d = policy.decide(first, {})
    assert d.shares == {"a": 1}
    a2 = msgspec.structs.replace(a, current_gpus=1, attained_service_gpu_s=100.0)
    b2 = msgspec.structs.replace(b, attained_service_gpu_s=20_000.0)
    table = {"a": a2, "b": b2}
    second = ClusterView(
        now_s=100.0,
        total_gpus=1,
        jobs=LiveJobs(table, serial=2, after=1, rebuilt=("a", "b"), left=()),
        arrival_ordered=True,
    )
    lazy = policy.decide(second, d.memory)
    _same(lazy, ElasticTiresias().decide_all(second, d.memory))
    assert "b" in lazy.memory["jobs"]  # demoted to G2: a place at its back


def test_compaction_shrinks_the_victim_first_in_pass_order_among_equals() -> None:
    """Two G1 victims with the same curve and GPUs lose the same per freed GPU: the one
    first in G1's list (pass order, not arrival order) is shrunk. Both forms agree."""
    curve = (0.0, 1.0, 1.5, 1.8, 2.0)

    def victim(job_id: str, arrival: float) -> JobView:
        return job(
            job_id,
            arrival_s=arrival,
            requested_gpus=4,
            max_gpus=4,
            throughput=curve,
            current_gpus=4,
            attained_service_gpu_s=1000.0,
        )

    late, early = victim("late", 5.0), victim("early", 1.0)
    # late holds the earlier place in G1's list: [base, first start, stopped, queue, position].
    memory = {"jobs": {"late": [0.0, 0.0, -1.0, 1.0, 0.0], "early": [0.0, 0.0, -1.0, 1.0, 1.0]}}
    # w waits in G2 (service past 10,000 GPU-s), behind both.
    w = job("w", arrival_s=0.0, requested_gpus=1, max_gpus=1, attained_service_gpu_s=20_000.0)
    v = view(100.0, 8, early, late, w)
    policy = ElasticTiresias(compaction_threshold=0)
    d = policy.decide(v, memory)
    assert d.shares == {"late": 3, "early": 4, "w": 1}
    _same(d, ElasticTiresias(compaction_threshold=0).decide_all(v, memory))

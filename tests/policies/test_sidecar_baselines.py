"""SideCar's baselines (Default-K8s, Termination), early initialisation, init and cross-host costs
in its predictions (issue 23, point 5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal.policies.base import ClusterView, JobView, check_decision, feasible_counts
from shoal.policies.registry import get_policy
from shoal.policies.sidecar import SideCarAdaptive, _Job
from shoal.policies.sidecar_baselines import DefaultK8s, Termination, options
from shoal.sim.costs import SIDECAR_PAPER, TERMINATION_PAPER, charge

from tests.policies.test_policy_properties import later, views
from tests.policies.test_sidecar import assert_keeping_changes_no_decision

CURVE = (0.0, 1.0, 1.7, 2.0, 2.4, 2.6, 2.8, 2.9, 3.0)


def job(
    job_id: str, *, arrival: float = 0.0, current: int = 0, remaining: float = 1000.0, request: int = 4
) -> JobView:
    return JobView(
        job_id=job_id,
        arrival_s=arrival,
        requested_gpus=request,
        max_gpus=8,
        throughput=CURVE,
        remaining_iterations=remaining,
        iterations_done=100.0 if current else 0.0,
        current_gpus=current,
    )


def view(*jobs: JobView, total: int = 8) -> ClusterView:
    return ClusterView(now_s=0.0, total_gpus=total, jobs=jobs)


def test_baselines_are_registered() -> None:
    assert isinstance(get_policy("sidecar-default-k8s", seed=3), DefaultK8s)
    assert isinstance(get_policy("sidecar-termination"), Termination)


def test_default_k8s_draws_a_fixed_optional_count_and_schedules_out_of_order() -> None:
    policy = DefaultK8s(seed=0)
    jobs = [job(f"j{i}", arrival=float(i)) for i in range(40)]
    counts = {j.job_id: policy.count(j) for j in jobs}
    assert set(counts.values()) <= set(options(jobs[0])) == {1, 2, 4, 8}
    assert len(set(counts.values())) > 1  # drawn, not the request
    assert counts == {j.job_id: DefaultK8s(seed=0).count(j) for j in jobs}  # a pure draw
    big = next(j for j in jobs if counts[j.job_id] == 8)
    small = next(j for j in jobs if counts[j.job_id] <= 2 and j.arrival_s > big.arrival_s)
    # 6 GPUs busy: the 8-GPU job waits, the later small one starts ahead of it.
    running = job("r", arrival=-1.0, current=4, request=4)
    other = job("r2", arrival=-1.0, current=2, request=2)
    v = view(running, other, big, small)
    d = policy.decide(v, {})
    check_decision(v, d)
    assert d.shares == {"r": 4, "r2": 2, small.job_id: counts[small.job_id]}


def test_termination_starts_at_the_minimum_and_only_adds_when_the_restart_pays() -> None:
    policy = Termination(costs=TERMINATION_PAPER)
    # A waiting job gets 1 GPU; nothing is added while a job waits.
    v = view(job("a", current=4), job("b", arrival=1.0), job("c", arrival=2.0), total=6)
    d = policy.decide(v, {})
    assert d.shares == {"a": 4, "b": 1, "c": 1}
    # No job waits: idle GPUs go to the running job whose finish falls most per GPU,
    # but never when the 223 s restart costs more than the faster run saves.
    short = job("s", current=1, remaining=100.0)
    long = job("l", current=1, remaining=100_000.0)
    d = policy.decide(view(short, long, total=4), {})
    assert d.shares == {"s": 1, "l": 2}
    # One add per decision: GPUs are left, so it asks to run again after the restart.
    assert d.memory["next_decision_at_s"] == pytest.approx(223.0)
    d = policy.decide(view(short, job("l", current=2, remaining=100_000.0), total=4), {})
    assert d.shares == {"s": 1, "l": 2} and "next_decision_at_s" not in d.memory  # 2 -> 4 needs 2 GPUs
    # Never reshapes down.
    d = policy.decide(view(job("x", current=4), job("y", arrival=1.0, request=4), total=4), {})
    assert d.shares == {"x": 4}


def test_early_initialisation_lets_the_victim_train_during_the_new_jobs_init() -> None:
    # The victim (4 -> 2 GPUs) trains 110 - 32 = 78 s more on 4 GPUs, then restarts 32 s.
    c = charge(SIDECAR_PAPER, "scale_in", 4, 2, rate_old=2.4, rate_new=1.7)
    assert c.stop_s == pytest.approx(max(0.0, 78 * (1 - 2.4 / 1.7) + 32))
    no_early = charge(TERMINATION_PAPER, "scale_in", 4, 2, rate_old=2.4, rate_new=1.7)
    assert no_early.stop_s == 223.0 and c.stop_s < 32.0


def test_sidecar_predictions_include_init_restart_and_cross_host() -> None:
    policy = SideCarAdaptive(costs=SIDECAR_PAPER)
    new = _Job(job("n"), 0, policy.options(job("n")))
    assert policy._finish(new, 2) == pytest.approx(110.0 + 1000.0 / 1.7)  # K8s + framework init
    running = _Job(job("r", current=2), 0, policy.options(job("r", current=2)))
    assert policy._finish(running, 4) == pytest.approx(32.0 + 1000.0 / 2.4)  # in-container restart
    # On 4-GPU hosts, 2 -> 8 GPUs needs a second host: a K8s terminate and restart on top.
    assert policy._finish(running, 8, gpus_per_node=4) == pytest.approx(32.0 + 191.0 + 1000.0 / 3.0)
    assert policy._finish(running, 4, gpus_per_node=4) == pytest.approx(32.0 + 1000.0 / 2.4)


def test_reproduction_workload_shape() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import sidecar_reproduction as rep
    finally:
        sys.path.pop(0)
    jobs = rep.workload("W2", 0)
    assert len(jobs) == 20 and all(0 <= j.submit_time_s <= 11000 for j in jobs)
    sc = rep.run_one("W2", 0, "sidecar", "sidecar-paper")
    de = rep.run_one("W2", 0, "sidecar-default-k8s", "termination-paper")
    assert sc["completed"] == de["completed"] == 20
    assert sc["removes"] > 0  # SideCar reshapes down for incoming jobs
    assert de["adds"] == de["removes"] == 0


@pytest.mark.parametrize(
    ("policy", "costs"),
    [("sidecar", "sidecar-paper"), ("sidecar-termination", "termination-paper"), ("sidecar-default-k8s", "")],
)
def test_shoal_simulate_runs_them(tmp_path: Path, policy: str, costs: str) -> None:
    from shoal.cli import main

    argv = ["simulate", "--trace", "philly:2869ce:25", "--policy", policy, "--gpus", "16", "--quiet"]
    argv += ["--output", str(tmp_path), *(["--costs", costs] if costs else [])]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["summary"]["completed"] == 25 and doc["policy"] == policy


def _literal_default_k8s(policy: DefaultK8s, v: ClusterView) -> dict[str, int]:
    """Default-K8s as first written: every job looked at, its options and draw computed
    afresh."""
    import hashlib

    jobs = sorted(v.jobs, key=lambda j: (j.arrival_s, j.job_id))
    shares: dict[str, int] = {}
    free = v.total_gpus
    for j in jobs:
        n = j.current_gpus
        if n and n <= free and n in feasible_counts(j):
            shares[j.job_id] = n
            free -= n
    for j in jobs:
        if j.job_id in shares:
            continue
        counts = feasible_counts(j)
        if not (j.allowed_gpu_counts or not j.elastic):
            counts = tuple(c for c in counts if c & (c - 1) == 0 or c == j.requested_gpus)
        opts = tuple(c for c in counts if c <= v.total_gpus)
        if not opts:
            continue
        h = hashlib.sha256(f"{policy.seed}:{j.job_id}".encode()).digest()
        n = opts[int.from_bytes(h[:8], "big") % len(opts)]
        if 0 < n <= free:
            shares[j.job_id] = n
            free -= n
    return shares


@settings(max_examples=120, deadline=None)
@given(v=views(max_jobs=16, max_gpus=12), seed=hs.integers(0, 3))
def test_default_k8s_walking_the_queue_while_gpus_are_free_decides_as_walking_it_all(
    v: ClusterView, seed: int
) -> None:
    """The running jobs found by one pass, the queue walked only while GPUs are free,
    the draws memoised: the same shares, in the same order, as the literal form, over a
    few rounds."""
    policy = DefaultK8s(seed=seed)
    for _ in range(3):
        fast = policy.decide(v, {})
        assert list(fast.shares.items()) == list(_literal_default_k8s(policy, v).items())
        v = later(v, fast, 60.0)


@pytest.mark.parametrize(
    "make", [lambda: DefaultK8s(seed=1), Termination], ids=["default-k8s", "termination"]
)
def test_keeping_the_running_jobs_and_draws_between_decisions_changes_no_decision(make: Any) -> None:
    """Each decides as an instance made fresh at every decision (which keeps nothing)."""
    assert_keeping_changes_no_decision(make)

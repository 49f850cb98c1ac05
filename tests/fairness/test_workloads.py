"""The §5.4-5.5 workload and the Philly slice with synthetic users."""

from __future__ import annotations

from collections import Counter

import pytest
from shoal.fairness.workloads import (
    SECTION55_GPUS,
    gavel_multi_gpu_models,
    normalised_k80,
    philly_users_workload,
    section55_curves,
    section55_workload,
    synthesise_users,
)


def test_section55_users_jobs_and_sizes() -> None:
    jobs = section55_workload()
    assert len(jobs) == 600
    per_user = Counter(j.spec.user for j in jobs)
    assert per_user == {"U1": 150, "U2": 150, "U3": 150, "U4": 150}
    sizes = {j.spec.user: j.spec.requested_gpus for j in jobs}
    assert sizes == {"U1": 1, "U2": 2, "U3": 4, "U4": 1}
    assert all(j.submit_time_s == 0.0 and not j.spec.elastic for j in jobs)
    assert all(set(j.throughput_by_type) == set(SECTION55_GPUS) for j in jobs)


def test_u1_finishes_in_four_hours_at_its_untraded_fair_share() -> None:
    jobs = [j for j in section55_workload() if j.spec.user == "U1"]
    curves = jobs[0].throughput_by_type
    # 3 V100 + 6 P100 + 16 K80 (§5.4), each running one U1 job at a time.
    rate = 3 * curves["v100"][1] + 6 * curves["p100"][1] + 16 * curves["k80"][1]
    work = sum(j.spec.total_iterations or 0 for j in jobs)
    assert work / rate == pytest.approx(4 * 3600, rel=1e-3)


def test_resnet_speedups_differ_by_gang_size_as_measured_by_gavel() -> None:
    resnet = section55_curves()["U1"]
    v100 = [resnet["v100"].throughput[k] / resnet["k80"].throughput[k] for k in (1, 2, 4)]
    assert v100 == pytest.approx([7.10, 6.27, 3.92], abs=0.01)
    superres = section55_curves()["U4"]
    assert superres["v100"].throughput[1] / superres["k80"].throughput[1] == pytest.approx(1.87)
    table1 = section55_curves("table1")["U3"]
    assert table1["v100"].throughput[4] / table1["k80"].throughput[4] == pytest.approx(5.14)
    with pytest.raises(ValueError):
        section55_curves("nope")


def test_normalised_k80_units_follow_table3() -> None:
    curves = {"k80": (0.0, 1.0, 1.8), "v100": (0.0, 5.0, 9.0)}
    assert normalised_k80(curves, "v100", 1) == 5.0
    assert normalised_k80(curves, "v100", 2) == 10.0
    assert normalised_k80(curves, "k80", 2) == 2.0
    assert normalised_k80(curves, "p100", 1) == 0.0


def test_length_jitter_is_seeded() -> None:
    a = section55_workload(jobs_per_user=5, length_jitter=0.2, seed=1)
    b = section55_workload(jobs_per_user=5, length_jitter=0.2, seed=1)
    c = section55_workload(jobs_per_user=5, length_jitter=0.2, seed=2)
    assert a == b and a != c
    lengths = {j.spec.total_iterations for j in a if j.spec.user == "U1"}
    assert len(lengths) > 1


def test_sweeps_stay_with_one_user_and_heavy_users_dominate() -> None:
    times = [0, 10, 20, 500, 510, 2000, 2001]
    requests = [1, 1, 1, 4, 4, 1, 2]
    owner = synthesise_users(times, requests, users=5, seed=3)
    assert owner[0] == owner[1] == owner[2]
    assert owner[3] == owner[4]
    assert owner == synthesise_users(times, requests, users=5, seed=3)
    many = synthesise_users([1000.0 * i for i in range(4000)], [1] * 4000, users=8, seed=0)
    counts = Counter(many)
    assert counts.most_common(1)[0][0] == 0
    assert counts[0] > 2 * counts[7]


def test_philly_users_workload_is_deterministic_and_gavel_backed() -> None:
    jobs = philly_users_workload(days=0.25)
    assert jobs == philly_users_workload(days=0.25)
    assert jobs[0].submit_time_s == 0.0
    assert all(1 <= j.spec.requested_gpus <= 8 and j.spec.max_gpus == 8 for j in jobs)
    models = set(gavel_multi_gpu_models())
    per_user: dict[str, set[str]] = {}
    for j in jobs:
        per_user.setdefault(j.spec.user, set()).add(j.spec.model)
        assert j.spec.model in models
    assert all(len(m) == 1 for m in per_user.values())
    # The trace duration holds on the reference generation (P100) at the request.
    j = jobs[0]
    p100 = j.throughput_by_type["p100"]
    assert (j.spec.total_iterations or 0) / p100[j.spec.requested_gpus] == pytest.approx(
        j.duration_s, abs=1.0
    )

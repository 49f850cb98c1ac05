"""Tiresias-L against the independent implementation of ``benchmarks/tiresias_reference.py``
(issue 23, point 9): every job ends at the same second on a heavily loaded slice, and a
one-rule change on either side is noticed."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from shoal.workloads import load_workload

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tiresias_reference.py"


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    return load_script(SCRIPT, "tiresias_reference_under_test")


@pytest.fixture(scope="module")
def jobs() -> list:
    # The first 600 jobs of 0e4a51 keep 64 GPUs overloaded: jobs pass 50 GPU-hours,
    # are demoted, preempted and restarted.
    return list(load_workload("philly:0e4a51:600", seed=0))


def test_every_job_ends_at_the_same_second(reference: ModuleType, jobs: list) -> None:
    ref = reference.simulate(jobs)
    assert len(ref) == len(jobs)
    assert reference.shoal_run(jobs) == ref


def test_whole_count_mode_agrees_too(reference: ModuleType, jobs: list) -> None:
    ref = reference.simulate(jobs, since_restart=False)
    assert reference.shoal_run(jobs, service_since_restart=False) == ref


@pytest.mark.parametrize(
    "variant", [{"since_restart": False}, {"wake_at_crossing": False}, {"keep_lists": False}]
)
def test_a_changed_rule_is_noticed(reference: ModuleType, jobs: list, variant: dict) -> None:
    assert reference.simulate(jobs, **variant) != reference.shoal_run(jobs)

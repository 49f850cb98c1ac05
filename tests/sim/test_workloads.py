"""Workloads: the 11 Philly VCs, Pollux, Poisson, and the AFS calibration rules."""

from __future__ import annotations

import pytest
from shoal.models import AFS_TABLE4_MODELS, afs_catalog, gavel_catalog, get_catalog
from shoal.sim.engine import SimConfig, Simulator
from shoal.workloads import (
    PHILLY_VCS,
    load_philly,
    load_workload,
    philly_rows,
    philly_summary,
    philly_vc_rows,
)

from tests.sim.toy_policies import ToyEqual


@pytest.mark.parametrize("vc", PHILLY_VCS)
def test_every_philly_vc_loads_as_in_the_afs_trace(vc: str) -> None:
    jobs = load_philly(vc, seed=0)
    summary = philly_summary()[vc]
    assert len(jobs) == int(summary["jobs_afs_pcs"])
    assert [j.submit_time_s for j in jobs] == sorted(j.submit_time_s for j in jobs)
    assert jobs[0].submit_time_s == 0.0
    assert max(j.spec.requested_gpus for j in jobs) <= min(52, int(summary["max_num_gpus"]))
    catalog = afs_catalog()
    for job in jobs[:500]:
        # The model is one of Table 4's nine and scales at least to the request.
        assert job.spec.model in AFS_TABLE4_MODELS
        curve = catalog.curve(job.spec.model, "")
        assert curve.max_gpus >= job.spec.requested_gpus
        assert job.spec.max_gpus == curve.max_gpus
        # Speedups are the catalog's (only the scale changes with calibration).
        k = job.spec.requested_gpus
        assert job.throughput[k] / job.throughput[1] == pytest.approx(curve.speedup(k), rel=1e-12)
        assert (job.spec.total_iterations or 0) / job.throughput[k] == pytest.approx(
            job.duration_s, rel=1e-12
        )


def test_each_vc_file_holds_its_rows_in_submission_order() -> None:
    """A simulation with ``--limit`` reads its VC's file only as far as its first jobs,
    which is the same as sorting the whole VC only because each file is stored sorted
    by (submission time, job id) and holds that VC's rows only."""
    rows = philly_rows()
    assert len(rows) == 109_493
    assert sum(r.in_afs_pcs_trace for r in rows) == 109_469
    for vc in PHILLY_VCS:
        mine = [r for r in rows if r.vc == vc]
        assert mine == sorted(mine, key=lambda r: (r.submit_time_s, r.job_id))
        assert len(mine) == int(philly_summary()[vc]["rows_in_file"])
        every = philly_vc_rows(vc, afs_only=False)
        assert every == mine
        afs = philly_vc_rows(vc)
        assert afs == [r for r in mine if r.in_afs_pcs_trace]
        assert philly_vc_rows(vc, limit=25) == afs[:25]


def test_model_draw_depends_only_on_the_seed() -> None:
    a = load_workload("philly:0e4a51:300", seed=7)
    b = load_workload("philly:0e4a51:300", seed=7)
    c = load_workload("philly:0e4a51:300", seed=8)
    assert a == b
    assert [j.spec.model for j in a] != [j.spec.model for j in c]
    # The draw is uniform over the eligible models: every 1-GPU-eligible model appears.
    assert {j.spec.model for j in a if j.spec.requested_gpus == 1} == set(AFS_TABLE4_MODELS)


def test_cap_at_request() -> None:
    capped = load_workload("philly:2869ce:50", seed=0, cap_at_request=True)
    assert all(j.spec.max_gpus == j.spec.requested_gpus for j in capped)


def test_pollux_workload_needs_explicit_run_times() -> None:
    with pytest.raises(ValueError, match="no run time"):
        load_workload("pollux:workloads:1")
    jobs = load_workload("pollux:workloads:1:duration_s=600")
    assert len(jobs) == 160
    assert all(j.duration_s == 600.0 for j in jobs)
    catalog = get_catalog("pollux-sia")
    for job in jobs:
        assert set(job.throughput_by_type) == set(catalog.curves[job.spec.model])
    result = Simulator(jobs[:30], ToyEqual(), SimConfig(total_gpus=16)).run()
    assert result.summary["completed"] == 30


def test_poisson_workload_options() -> None:
    jobs = load_workload("poisson:n=50,rate=10,mean_duration_s=600,users=3", seed=4)
    assert len(jobs) == 50
    assert {j.spec.user for j in jobs} == {"user-0", "user-1", "user-2"}
    assert jobs == load_workload("poisson:n=50,rate=10,mean_duration_s=600,users=3", seed=4)
    assert all(j.submit_time_s == int(j.submit_time_s) for j in jobs)
    single = load_workload("poisson:n=5,rate=10")
    assert {j.spec.user for j in single} == {"default"}


def test_poisson_gavel_jobs_carry_every_generation() -> None:
    jobs = load_workload("poisson:n=40,rate=10,catalog=gavel", seed=1)
    catalog = gavel_catalog()
    for job in jobs:
        assert set(job.throughput_by_type) == set(catalog.curves[job.spec.model])
        k = job.spec.requested_gpus
        # Calibrated on the reference generation (V100) ...
        assert job.throughput_by_type["v100"][: k + 1] == pytest.approx(job.throughput[: k + 1])
        assert (job.spec.total_iterations or 0) / job.throughput[k] == pytest.approx(job.duration_s)
        # ... with Gavel's ratios between generations.
        for gpu_type, curve in job.throughput_by_type.items():
            measured = catalog.curve(job.spec.model, gpu_type).throughput
            ref = catalog.curve(job.spec.model, "v100").throughput
            assert curve[1] / job.throughput[1] == pytest.approx(measured[1] / ref[1])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("philly:nope", "unknown Philly VC"),
        ("nope:1", "unknown workload kind"),
        ("poisson:n=3", "needs n= and rate="),
        ("poisson:n=3,rate=1,colour=red", "unknown poisson parameters"),
        ("poisson:n=3,rate=1,catalog=nope", "unknown catalog"),
        ("poisson:n=3,rate=1,catalog=gavel,reference=h100", "no 'h100' curve"),
        ("pollux:workloads", "pollux workload spec"),
        ("pollux:workloads:99:duration_s=1", "no Pollux workload"),
    ],
)
def test_bad_workload_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_workload(spec)


@pytest.mark.parametrize("vc", PHILLY_VCS)
def test_every_philly_vc_simulates_to_completion(vc: str) -> None:
    """Every VC runs through the simulator with AFS-P on the paper's cluster (64 GPUs,
    16 servers, network packing, min-migration placement): its first 50 jobs here;
    the whole VC in the slow test below and in ``benchmarks/afs_reproduction.py``.
    (Long traces get expensive early: 7f04ca's first 100 jobs keep 64 GPUs contended
    for 95 days, and AFS-P re-decides at every lease end that evicts: 12,761 decisions.)"""
    from shoal.sim.engine import make_policy

    jobs = load_workload(f"philly:{vc}:50", seed=0)
    result = Simulator(jobs, make_policy("afs-p"), SimConfig()).run()
    assert result.summary["completed"] == len(jobs) == 50
    assert result.summary["avg_jct_s"] > 0
    assert result.summary["makespan_s"] >= jobs[-1].submit_time_s - jobs[0].submit_time_s


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("vc", PHILLY_VCS)
def test_every_whole_philly_vc_simulates_to_completion(vc: str) -> None:
    """Whole VCs with AFS-P in the AFS simulator's setting (a flat pool of 64 GPUs,
    free reconfigurations): 6214e9's 51,258 jobs take about eight minutes on one core
    (``benchmarks/reports/simulation_speed.md``)."""
    from shoal.sim.engine import make_policy

    jobs = load_workload(f"philly:{vc}", seed=0)
    result = Simulator(jobs, make_policy("afs-p"), SimConfig(flat=True, retain_log=False)).run()
    assert result.summary["completed"] == len(jobs) == int(philly_summary()[vc]["jobs_afs_pcs"])

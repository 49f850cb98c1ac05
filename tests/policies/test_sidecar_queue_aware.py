"""The SideCar benchmark's test of cause (1) of its makespan gap to Termination
(``benchmarks/sidecar_reproduction.py``: ``QueueAwareSideCar``, MS_predict over the
queued jobs too): on a hand-made queue the two readings of MS_predict decide apart."""

from __future__ import annotations

from pathlib import Path

from shoal.policies.sidecar import SideCarAdaptive
from shoal.sim.costs import get_costs

from tests.policies.test_tiresias import job, view
from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sidecar_reproduction.py"
SUBLINEAR = (0.0, 1.0, 1.5, 1.8, 2.0)


def test_counting_the_queue_starts_four_sublinear_jobs_side_by_side() -> None:
    bench = load_script(SCRIPT, "sidecar_reproduction_under_test")
    # Four equal jobs queued on 4 free GPUs, 1,000 iterations each, 2 it/s at best on 4.
    jobs = [
        job(
            n,
            arrival_s=float(i),
            requested_gpus=1,
            max_gpus=4,
            throughput=SUBLINEAR,
            remaining_iterations=1000.0,
        )
        for i, n in enumerate("abcd")
    ]
    free = get_costs("free")
    # MS_predict over the running jobs and the incoming one: the first job takes all 4 GPUs
    # (done at 500 s); the others wait, one after another (makespan 2,000 s).
    assert SideCarAdaptive(costs=free).decide(view(10.0, 4, *jobs), {}).shares == {"a": 4}
    # Over the queue too: one GPU each, all done at 1,000 s.
    queue_aware = bench.QueueAwareSideCar(costs=free)
    assert queue_aware.decide(view(10.0, 4, *jobs), {}).shares == {"a": 1, "b": 1, "c": 1, "d": 1}

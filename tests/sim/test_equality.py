"""The simulator computes the same without keeping its log, and the equality harness
(``benchmarks/sim_equality.py``) notices a difference."""

from __future__ import annotations

from pathlib import Path

import msgspec
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.workloads import load_workload

from tests.scripts import load_script


def _harness():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_equality.py"
    return load_script(path, "sim_equality", register=True)


def test_not_retaining_the_log_changes_nothing_but_the_envelopes() -> None:
    jobs = load_workload("philly:0e4a51:60", seed=1)
    results = []
    for retain in (True, False):
        sim = Simulator(jobs, make_policy("afs-p"), SimConfig(retain_log=retain))
        results.append((sim.run(), len(sim.log.envelopes)))
    (kept, n_kept), (bare, n_bare) = results
    assert n_kept == kept.summary["events"] > 0 and n_bare == 0
    assert kept.final_digest == bare.final_digest
    assert kept.event_counts == bare.event_counts
    assert list(kept.event_counts) == list(bare.event_counts)  # first-seen order too
    assert msgspec.json.encode(kept.summary) == msgspec.json.encode(bare.summary)
    assert msgspec.json.encode(kept.series) == msgspec.json.encode(bare.series)
    assert msgspec.json.encode(kept.jobs) == msgspec.json.encode(bare.jobs)


def test_harness_finds_a_changed_series_value_and_nothing_in_equal_runs() -> None:
    h = _harness()
    run = h.record_one("philly:2869ce:15", "srtf", 0, True)
    base = {"shoal": "a", "runs": [run]}
    assert h.compare(base, {"shoal": "b", "runs": [dict(run)]}) == []
    changed = dict(run, series=dict(run["series"], ce=[*run["series"]["ce"][:-1], (0.5).hex()]))
    diffs = h.compare(base, {"shoal": "b", "runs": [changed]})
    assert len(diffs) == 1 and "series differs" in diffs[0]
    assert "missing" in h.compare(base, {"shoal": "b", "runs": []})[0]

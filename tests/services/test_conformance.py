"""Emulate agrees with simulate: the same trace slice, policy, seed and cost model through
the live stack (real nats-server, services, sidecar processes) and through ``shoal simulate``.

The default run replays 50 Philly jobs of VC 0e4a51 on 4 × 4 GPUs at 20,000× on the
synchronized clock, and 12 on a free-running clock; the ``slow`` runs replay 100 jobs
under three policies, and 12 with AFS §4.5's overestimate-first live (the profiler
measures, the allocator probes). ``python benchmarks/conformance.py`` writes the report.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
from shoal import codec
from shoal import events as ev
from shoal.profiling import OVERESTIMATE_KIND
from shoal_services.conformance import (
    ConformanceConfig,
    arrival_difference,
    compare,
    first_difference,
    model_updates,
    sequence_agreement,
    share_sequence,
)

from tests.scripts import load_script

pytestmark = pytest.mark.integration


def decided(at: float, trigger: str, **shares: int) -> ev.Envelope:
    return codec.wrap(ev.SharesDecided(epoch=1, shares=shares, trigger=trigger), at=at)


def test_share_sequence_drops_repeats_and_filters_by_trigger() -> None:
    log = [
        decided(0.0, "arrival", a=2),
        decided(5.0, "tick", a=2),
        decided(6.0, "arrival", a=2, b=1),  # part of a burst at t=6, superseded at once
        decided(6.0, "arrival", a=1, b=1),
        decided(9.0, "completion", b=2),
    ]
    assert share_sequence(log) == [{"a": 2}, {"a": 1, "b": 1}, {"b": 2}]
    assert share_sequence(log, "arrival") == [{"a": 2}, {"a": 1, "b": 1}]
    # A decision that only drops a job that finished meanwhile says nothing new (the
    # allocator does not publish it, the simulator does); one that also moves another
    # job's share does.
    done = codec.wrap(ev.JobCompleted(job_id="a", iterations=1), at=7.0)
    assert share_sequence([*log[:4], done, decided(7.0, "completion", b=1)]) == [{"a": 2}, {"a": 1, "b": 1}]
    assert share_sequence([*log[:4], done, decided(7.0, "completion", b=2)])[-1] == {"b": 2}
    assert share_sequence([*log[:4], done, decided(7.0, "completion", b=1), decided(8.0, "tick")]) == [
        {"a": 2},
        {"a": 1, "b": 1},
        {},
    ]
    assert sequence_agreement([{"a": 1}, {"b": 1}], [{"a": 1}, {"c": 1}, {"b": 1}]) == pytest.approx(2 / 3)
    assert sequence_agreement([], []) == 1.0


def test_arrival_difference_names_a_decision_labelled_with_another_trigger() -> None:
    """The same decisions in both logs, one of them caused by an arrival on one side and
    labelled a completion on the other: the decision sequences agree, the arrival ones do
    not, and the report says where and how each side labelled it."""
    sim = [decided(0.0, "arrival", a=2), decided(6.0, "arrival", a=1, b=1), decided(9.0, "completion", b=2)]
    emu = [
        decided(0.0, "arrival", a=2),
        decided(6.0, "completion", a=1, b=1),
        decided(9.0, "completion", b=2),
    ]
    assert share_sequence(sim) == share_sequence(emu)
    assert arrival_difference(sim, sim) is None
    assert arrival_difference(sim, emu) == {
        "index": 1,
        "sim": (6.0, "arrival"),
        "emu": None,
        "sim_shares_in_emu": [(6.0, "completion")],
        "emu_shares_in_sim": [],
    }


def test_fifty_jobs_agree_one_for_one_on_the_synchronized_clock(nats_url: str) -> None:
    """50 jobs at 20,000× (about a minute): on the synchronized clock the
    emulated stack makes the simulator's share decisions, one for one, and its job
    times agree to within rounding (see :class:`shoal.clock.SharedClock`)."""
    out = compare(
        ConformanceConfig(trace="philly:0e4a51:50", policy="afs-p", time_scale=20_000.0),
        nats_url,
        os.environ["NATS_CREDS"],
    )
    assert out["emu_completed"] == out["sim_completed"] == 50
    assert out["emu_decisions"] == out["sim_decisions"], out
    assert out["decision_agreement"] == 1.0, out
    assert out["arrivals_agree"], out
    assert out["jct_rel_diff"] < 0.001, out
    assert out["emu_makespan_s"] == out["sim_makespan_s"], out


def test_free_running_clock_agrees_on_a_reduced_slice(nats_url: str) -> None:
    """Without the synchronized clock (``StackConfig.synchronized=False``, what a
    long-running ``shoal up`` uses) the emulated stack keeps time on its own."""
    cfg = ConformanceConfig(trace="philly:0e4a51:12", policy="afs-p", time_scale=1000.0, synchronized=False)
    out = compare(cfg, nats_url, os.environ["NATS_CREDS"])
    assert out["emu_completed"] == out["sim_completed"] == 12
    assert out["jct_rel_diff"] < 0.05, out
    # Arrivals are stamped with their trace instants, so the decisions they trigger
    # are the simulator's, one for one.
    assert out["arrivals_agree"], out
    # Completion-triggered decisions can merge or swap when a process runs late by more
    # than the gap between two completions (a loaded CI machine at 1000×).
    assert out["decision_agreement"] >= 0.8, out


@pytest.mark.slow
@pytest.mark.parametrize(("trace", "policy"), [("0e4a51:75", "afs-p"), ("0e4a51:100", "max-min")])
def test_contended_slices_agree_one_for_one(nats_url: str, trace: str, policy: str) -> None:
    """Slices where AFS-P rotates leases (periodic decisions) and Max-Min re-splits, at 10,000×."""
    cfg = ConformanceConfig(trace=f"philly:{trace}", policy=policy, time_scale=10_000.0)
    out = compare(cfg, nats_url, os.environ["NATS_CREDS"])
    assert out["emu_completed"] == out["sim_completed"] == out["jobs"]
    assert out["decision_agreement"] == 1.0, out
    assert out["jct_rel_diff"] < 0.001, out


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "conformance.py"
    return load_script(path, "bench_conformance")


def test_overestimate_cases_and_their_counts() -> None:
    parse = _bench().parse_case
    cfg = parse("philly:0e4a51:12,afs-p,1000,overestimate=60")
    assert (cfg.profiling, cfg.measure_s, cfg.synchronized) == ("overestimate", 60.0, True)
    assert parse("philly:0e4a51:12,afs-p,1000,free").profiling == "oracle"
    for bad in ("a,b,1,overestimate,overestimate", "a,b,1,sync", "a,b"):
        with pytest.raises(ValueError):
            parse(bad)
    with pytest.raises(ValueError):
        ConformanceConfig(profiling="guess")
    model = ev.ThroughputModelUpdated(
        job_id="a", gpu_type="", model_kind=OVERESTIMATE_KIND, throughput={1: 1.0}
    )
    table = ev.ThroughputModelUpdated(job_id="a", gpu_type="", model_kind="table", throughput={1: 1.0})
    assert model_updates([codec.wrap(model), codec.wrap(table)]) == 1
    assert first_difference([{"a": 2}], [{"a": 2}]) is None
    assert first_difference([{"a": 2}, {"a": 1, "b": 1}], [{"a": 2}, {"a": 2}]) == (
        1,
        {"a": 1, "b": 1},
        {"a": 2, "b": 0},
    )
    assert first_difference([{"a": 2}], [{"a": 2}, {}]) == (1, {}, {})


@pytest.mark.slow
def test_overestimate_first_runs_live_and_agrees_with_the_simulator(nats_url: str) -> None:
    """AFS §4.5 on both sides (about two minutes on two busy cores): the simulator with
    ``profiling="overestimate"``, the emulated stack with the profiler and no curve given
    to the allocator. New jobs start at their fair share, are taken through their smaller
    units as measurements arrive, and the two runs make the same decisions.

    A hand-over hold that lapses on an overloaded machine (10 s without an answer) lets
    the clock run past a measurement and the sequences then part (see the report); the
    bounds below leave room for one such lapse."""
    cfg = ConformanceConfig(
        trace="philly:0e4a51:12", policy="max-min", time_scale=1000.0, profiling="overestimate"
    )
    out = compare(cfg, nats_url, os.environ["NATS_CREDS"])
    assert out["emu_completed"] == out["sim_completed"] == 12
    # §4.5 happened on both sides: one estimate per newly measured count, and decisions it caused.
    assert out["sim_model_updates"] > 12 and out["sim_probe_decisions"] > 0, out
    assert abs(out["emu_model_updates"] - out["sim_model_updates"]) <= 2, out
    assert out["emu_probe_decisions"] > 0, out
    assert out["arrivals_agree"], out
    assert out["decision_agreement"] >= 0.9, out
    assert out["jct_rel_diff"] < 0.01, out

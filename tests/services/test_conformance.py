"""Emulate agrees with simulate: the same trace slice, policy, seed and cost model through
the live stack (real nats-server, services, sidecar processes) and through ``shoal simulate``.

The default run replays 50 Philly jobs of VC 0e4a51 on 4 × 4 GPUs at 10,000× on the
synchronized clock, and 12 on a free-running clock; the ``slow`` runs replay 100 jobs
under three policies. ``python benchmarks/conformance.py`` writes the report.
"""

from __future__ import annotations

import os

import pytest
from shoal import codec
from shoal import events as ev
from shoal_services.conformance import ConformanceConfig, compare, sequence_agreement, share_sequence

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


def test_fifty_jobs_agree_one_for_one_on_the_synchronized_clock(nats_url: str) -> None:
    """50 jobs at 10,000× (about a minute and a half): on the synchronized clock the
    emulated stack makes the simulator's share decisions, one for one, and its job
    times agree to within rounding (see :class:`shoal.clock.SharedClock`)."""
    out = compare(
        ConformanceConfig(trace="philly:0e4a51:50", policy="afs-p", time_scale=10_000.0),
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

"""Smoke test of benchmarks/bench_services.py: its cases at tiny sizes on a real nats-server."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_services.py"


def _load() -> ModuleType:
    return load_script(SCRIPT, "bench_services", register=True)


bench = _load()


async def test_submission_to_placement(nats_url: str, prefix: str, admin_creds: str) -> None:
    r = await bench.latency_case(
        nats_url, prefix, active=5, probes=3, nodes=3, probe_timeout_s=15, creds=admin_creds
    )
    assert len(r["placed_ms"]) == 3
    assert all(0 < ms < 15_000 for ms in r["placed_ms"])
    # The share decision comes before the placement. (Admission replies once its own
    # projection has folded the submission, which may be after the allocator decided.)
    for reply, shared, placed in zip(r["reply_ms"], r["shared_ms"], r["placed_ms"], strict=True):
        assert reply > 0 and shared <= placed
    assert r["active_at_end"] == 5  # every probe was cancelled again
    assert r["decisions"] >= 1 + 3


async def test_submission_throughput_loses_nothing(nats_url: str, prefix: str, admin_creds: str) -> None:
    r = await bench.throughput_case(nats_url, prefix, n=20, window=8, creds=admin_creds)
    assert r["sent"] == len(r["accepted"]) == r["logged"] == 20, (r["errors"], r["rejected"])
    assert r["logged_ids_match"]
    assert not r["rejected"] and not r["errors"] and not r["duplicates"]
    assert r["rate"] > 0


async def test_allocator_cold_start_matches_full_fold(nats_url: str, prefix: str, admin_creds: str) -> None:
    r = await bench.cold_start_case(
        nats_url, prefix, events=2_000, tails=(100, 1_000), runs=1, creds=admin_creds
    )
    assert r["events"] == 2_000
    assert len(r["full_s"]) == 1
    assert sorted(r["with_snapshot_s"]) == [100, 1_000]
    assert r["snapshot_bytes"] > 0
    assert r["jobs"] == 1_000  # 2,000 events: 64 nodes, 1,000 submissions, then steady state


def test_history_is_deterministic_and_sized() -> None:
    chunks = list(bench.history_chunks(3_000, chunk=1_000))
    assert [len(c) for c in chunks] == [1_000, 1_000, 1_000]
    again = [e.event for c in bench.history_chunks(3_000, chunk=1_000) for e in c]
    assert [e.event for c in chunks for e in c] == again


def test_percentile_is_nearest_rank() -> None:
    xs = list(range(1, 101))
    assert bench.pct(xs, 50) == 50
    assert bench.pct(xs, 99) == 99
    assert bench.pct([7.0], 99) == 7.0

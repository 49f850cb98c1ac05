"""The synchronized clock of an emulated installation (:class:`shoal.clock.SharedClock`).

Real processes share it through its file; wall time is real, so the checks compare
virtual readings with generous margins rather than exact values.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from shoal.clock import HOLD_TTL_S, ScaledClock, SharedClock, hold, release

SCALE = 1000.0


def wait_for_reading(clock: SharedClock, at: float, timeout_s: float = 10.0) -> float:
    """The clock's reading once it has reached ``at`` (held there by a barrier), polled
    so that a loaded machine's slow wall time does not decide the check."""
    deadline = time.monotonic() + timeout_s
    while (now := clock.now()) < at and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


@pytest.fixture
def clock(tmp_path: Path) -> SharedClock:
    return SharedClock.create(tmp_path / "clock", SCALE, origin=1_000_000.0)


def test_it_runs_scaled_and_stops_at_a_barrier(clock: SharedClock) -> None:
    t0 = clock.now()
    time.sleep(0.02)
    assert clock.now() - t0 >= 0.02 * SCALE * 0.9
    # 200 ms of wall time ahead: a barrier only 5 ms ahead had passed once before the
    # hold was set (a loaded CI machine), and a hold never moves time back.
    at = clock.now() + 200.0
    clock.hold("next-arrival", at, ttl_s=None)
    time.sleep(0.3)  # 300 virtual seconds of wall time: the clock waits at the barrier
    assert clock.now() == pytest.approx(at)
    assert clock.barriers() == {"next-arrival": pytest.approx(at)}


def test_release_resumes_from_the_barrier_without_a_jump(clock: SharedClock) -> None:
    # 100 ms of wall time ahead, so a slow hold call on a loaded machine still sets it
    # ahead of the clock (a hold that arrives late holds where the clock already is).
    at = clock.now() + 100.0
    clock.hold("b", at, ttl_s=None)
    held = wait_for_reading(clock, at)
    time.sleep(0.5)  # held for 500 virtual seconds more
    t0 = time.monotonic()
    clock.release("b")
    after = clock.now()
    ran = time.monotonic() - t0  # wall time the clock may have run since the release
    assert held <= after <= held + (ran + 0.005) * SCALE  # not held + 500: the held time is not made up
    time.sleep(0.02)
    assert clock.now() - after >= 0.02 * SCALE * 0.9


def test_a_hold_never_moves_time_back(clock: SharedClock) -> None:
    now = clock.now()
    clock.hold("late", now - 100.0)  # an instant already past: held where the clock is
    held = clock.now()
    assert held >= now
    time.sleep(0.02)
    assert clock.now() == pytest.approx(held, abs=1e-6)


def test_the_lowest_of_several_barriers_holds_and_release_is_per_key(clock: SharedClock) -> None:
    # Barriers 200 ms and more of wall time ahead: ones a few ms ahead had passed before
    # the hold was set on a loaded CI machine.
    now = clock.now()
    clock.hold("far", now + 400.0, ttl_s=None)
    clock.hold("near", now + 200.0, ttl_s=None)
    assert wait_for_reading(clock, now + 200.0) == pytest.approx(now + 200.0)
    time.sleep(0.03)
    assert clock.now() == pytest.approx(now + 200.0)  # held: the far barrier is not reached
    clock.release("near", "not-held")
    assert wait_for_reading(clock, now + 400.0) == pytest.approx(now + 400.0)
    clock.hold("far", now + 600.0, ttl_s=None)  # the same key moves its barrier
    assert wait_for_reading(clock, now + 600.0) == pytest.approx(now + 600.0)
    time.sleep(0.03)
    assert clock.now() == pytest.approx(now + 600.0)


def test_other_processes_see_the_same_clock_and_their_holds(clock: SharedClock) -> None:
    code = (
        "import sys; from shoal.clock import SharedClock\n"
        "c = SharedClock(sys.argv[1])\n"
        "c.hold('other', c.now(), ttl_s=30)\n"
        "print(repr(c.now()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, clock.path], capture_output=True, text=True, check=True)
    seen = float(out.stdout)
    time.sleep(0.03)
    # Held by a hand-over hold from a process that has exited: it stays until released.
    assert clock.now() == pytest.approx(seen, abs=1e-6)
    assert "other" in clock.barriers()
    clock.release("other")
    time.sleep(0.02)
    assert clock.now() > seen + 0.01 * SCALE


def test_a_barrier_of_a_dead_process_is_dropped_where_it_stood(clock: SharedClock) -> None:
    code = (
        "import sys; from shoal.clock import SharedClock\n"
        "c = SharedClock(sys.argv[1])\n"
        "c.hold('finish', c.now(), ttl_s=None)\n"  # owned by this process, which then exits
        "print(repr(c.now()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, clock.path], capture_output=True, text=True, check=True)
    held = float(out.stdout)
    t0 = time.monotonic()
    first = clock.now()  # drops the dead process's barrier, re-based at its instant
    ran = time.monotonic() - t0
    assert held <= first <= held + (ran + 0.005) * SCALE  # not the wall time since the exit
    assert "finish" not in clock.barriers()
    time.sleep(0.02)
    assert clock.now() > first + 0.01 * SCALE


def test_a_hand_over_hold_nobody_releases_lapses(clock: SharedClock) -> None:
    assert HOLD_TTL_S >= 1.0  # a lost message costs seconds, not the run
    placed = time.monotonic()
    clock.hold("lost", ttl_s=0.5)
    held = clock.now()
    time.sleep(0.03)
    if time.monotonic() < placed + 0.5:  # (a loaded machine may not have run us sooner)
        assert clock.now() == pytest.approx(held, abs=1e-6)
    deadline = time.monotonic() + 10.0
    while clock.barriers() and time.monotonic() < deadline:
        clock.now()  # a reader drops the lapsed hold
        time.sleep(0.01)
    lapsed = clock.now()
    assert time.monotonic() >= placed + 0.5
    assert clock.barriers() == {}
    # It continues from where it stood, not from where free-running time would be.
    assert held <= lapsed < held + (time.monotonic() - placed - 0.5 + 0.02) * SCALE


def test_the_creator_sets_how_long_hand_over_holds_live(tmp_path: Path) -> None:
    """A conformance run (nothing is lost, but a loaded machine is slow) makes holds
    live longer; every process that opens the clock stretches its holds alike."""
    SharedClock.create(tmp_path / "c", SCALE, hold_ttl_s=3 * HOLD_TTL_S)
    other = SharedClock(tmp_path / "c")
    assert other.ttl_factor == 3.0
    before = time.monotonic()
    other.hold("slow", ttl_s=0.5)
    expires = msgspec.json.decode((tmp_path / "c").read_bytes())["barriers"]["slow"][2]
    assert before + 1.5 <= expires <= time.monotonic() + 1.5
    with pytest.raises(ValueError, match="hold_ttl_s must be positive"):
        SharedClock.create(tmp_path / "d", SCALE, hold_ttl_s=0.0)


def test_sleep_waits_for_virtual_time_including_the_held_part(clock: SharedClock) -> None:
    start = clock.now()
    clock.hold("b", start + 2.0, ttl_s=None)

    async def scenario() -> float:
        sleeper = asyncio.create_task(clock.sleep(5.0))
        await asyncio.sleep(0.03)
        assert not sleeper.done()  # the clock waits at start + 2
        clock.release("b")
        await asyncio.wait_for(sleeper, 2.0)
        return clock.now()

    assert asyncio.run(scenario()) >= start + 5.0


def test_holds_are_no_ops_on_other_clocks() -> None:
    c = ScaledClock(SCALE)
    hold(c, "x", c.now())
    release(c, "x")
    t0 = c.now()
    time.sleep(0.01)
    assert c.now() > t0


def test_bad_scale_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="time scale must be positive"):
        SharedClock.create(tmp_path / "c", 0.0)

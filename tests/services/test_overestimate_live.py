"""AFS §4.5 live, piece by piece, against a real nats-server: the profiler's measurement
window, its holds on a synchronized clock, and the emulated trainer's hand-over report.

The whole path (allocator, profiler, emulated trainers) is compared with the simulator
in ``tests/services/test_conformance.py`` (``profiling="overestimate"``).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.clock import SharedClock, hold_key, measure_key, model_key
from shoal_services.profiler.service import ProfilerService

from tests.services.test_allocator_placer import events_of
from tests.services.test_emulated_trainer import ManualClock as TrainerClock
from tests.services.test_emulated_trainer import refs, trainer
from tests.services.test_profiler import ManualClock, report, start, submitted, updates, wait_until

pytestmark = pytest.mark.integration

T = 1_000.0


async def running(bus: Bus, at: float, world: int, epoch: int = 1) -> None:
    """The job ``j`` was given ``world`` GPUs at ``at`` and resumed at once."""
    await bus.publish(codec.wrap(ev.SharesDecided(epoch=epoch, shares={"j": world}), at=at))
    await bus.publish(
        codec.wrap(ev.ReconfigurationCompleted(job_id="j", epoch=epoch, world_size=world), at=at)
    )


async def test_a_count_is_measured_only_after_its_window(bus: Bus) -> None:
    """A report made before the job ran ``min_interval_s`` at its count (from the end of
    its stop) is no measurement; the first one after the window is."""
    clock = ManualClock(T)
    prof = ProfilerService(bus, holder="p1", clock=clock, min_interval_s=30.0)
    await bus.publish(codec.wrap(submitted("j", max_gpus=4), at=T))
    await running(bus, T, 4)
    stop, task = await start(prof)
    try:
        # A hand-over report 10 s into the window (the share was cut short): nothing.
        r = await bus.publish(codec.wrap(report("j", 4, 8.0), at=T + 10))
        await wait_until(lambda: prof.projection.last_seq >= r.seq and prof.passes >= 1)
        assert prof.book.measured("j", "") == {}
        clock.t = T + 30
        await bus.publish(codec.wrap(report("j", 4, 8.0, iteration=20), at=T + 30))
        await wait_until(lambda: prof.published == 1)
        # Shrunk to 2 at T + 40: a report at 4 GPUs after that (a leader late to apply
        # its order) is no measurement; the hand-over report at the change instant is.
        await running(bus, T + 40, 2, epoch=2)
        r = await bus.publish(codec.wrap(report("j", 4, 99.0, iteration=30), at=T + 45))
        await wait_until(lambda: prof.projection.last_seq >= r.seq)
        await bus.publish(codec.wrap(report("j", 4, 8.5, iteration=25), at=T + 40))
        await wait_until(lambda: prof.book.samples("j", "") == 2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert prof.book.measured("j", "") == {4: pytest.approx(8.25)}
    assert [(u.measured, u.overestimated) for u in await updates(bus)] == [((4,), True)]


async def test_a_newly_measured_count_is_not_held_back_by_the_min_interval(bus: Bus) -> None:
    """Its own window already spaced it; the allocator's next §4.5 step waits for it."""
    clock = ManualClock(T)
    prof = ProfilerService(bus, holder="p1", clock=clock, min_interval_s=30.0)
    await bus.publish(codec.wrap(submitted("j", max_gpus=4), at=T))
    stop, task = await start(prof)
    try:
        await bus.publish(codec.wrap(report("j", 4, 8.0), at=T))
        await wait_until(lambda: prof.published == 1)
        await bus.publish(codec.wrap(report("j", 2, 4.0), at=T))  # the same instant
        await wait_until(lambda: prof.published == 2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert [u.measured for u in await updates(bus)] == [(4,), (2, 4)]


async def test_on_a_synchronized_clock_the_window_end_is_held_until_the_count_is_published(
    bus: Bus, tmp_path: Path
) -> None:
    clock = SharedClock.create(tmp_path / "clock", scale=1.0)
    window = 2.0
    prof = ProfilerService(bus, holder="p1", clock=clock, min_interval_s=window)
    at = math.floor(clock.now())
    await bus.publish(codec.wrap(submitted("j", max_gpus=4), at=at))
    stop, task = await start(prof)
    try:
        await running(bus, at, 4)
        end = float(math.ceil(at + window))
        await wait_until(lambda: clock.barriers().get(measure_key("j")) == end)
        # Virtual time stops there (nothing else holds it) until the count is published.
        await wait_until(lambda: clock.now() == end, timeout=10)
        assert prof.published == 0
        await bus.publish(codec.wrap(report("j", 4, 8.0), at=end))
        await wait_until(lambda: prof.published == 1)
        barriers = clock.barriers()
        # Let go of; the model is out under a hold of its own, for the allocator.
        assert measure_key("j") not in barriers and barriers[model_key("j", "")] == end
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    (model,) = await updates(bus)
    assert hold_key(model) == model_key("j", "")


async def test_the_hand_over_report_carries_the_rate_of_the_shape_it_names(bus: Bus) -> None:
    """Two orders at one instant (2 → 4 → 1 GPUs at t = 100): the hand-over report of the
    second names the shape the job ran on until then (2 GPUs) and must carry its rate,
    not the rate of the order it replaces (4 GPUs), or the profiler measures 4 it/s at 2."""
    clock = TrainerClock()
    t = await trainer(bus, clock)  # linear curve: k it/s on k GPUs
    await t.apply(ev.Reconfigure(job_id="j", epoch=2, gpus=refs(2), effective_at=0.0))
    clock.advance(100.0)
    await t.apply(ev.Reconfigure(job_id="j", epoch=3, gpus=refs(4), effective_at=100.0))
    await t.apply(ev.Reconfigure(job_id="j", epoch=4, gpus=refs(1), effective_at=100.0))
    reports = await events_of(bus, ev.ProgressReported)
    assert reports and all(r.samples_per_s == r.num_gpus for r in reports), reports

"""The emulated trainer obeys orders as the real sidecar does: stale epochs are ignored,
a newer epoch cancels the reconfiguration in flight (CoDDL §4.3), stop times come from
the cost model, and the job completes at its exact finish instant."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.reporting import ReportBackoff
from shoal.sim.costs import get_costs
from shoal_services.trainer_sidecar.emulated import EmulatedTrainer

from tests.services.test_allocator_placer import events_of

pytestmark = pytest.mark.integration


class ManualClock:
    """A clock the test moves by hand (virtual seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, to: float) -> None:
        self.t = to


def refs(n: int) -> tuple[ev.GpuRef, ...]:
    return tuple(ev.GpuRef(node_id="n0", index=i) for i in range(n))


async def trainer(bus: Bus, clock: ManualClock) -> EmulatedTrainer:
    spec = ev.JobSpec(user="u", min_gpus=1, max_gpus=4, requested_gpus=2, total_iterations=1000)
    await bus.publish(codec.wrap(ev.JobSubmitted(job_id="j", spec=spec), at=0.0))
    t = EmulatedTrainer(bus, "j", "n0", clock=clock, costs=get_costs("scale_out=30,scale_in=30"))
    await t.load()
    return t


async def test_newer_epoch_cancels_the_one_in_flight_and_stale_ones_are_ignored(bus: Bus) -> None:
    clock = ManualClock()
    t = await trainer(bus, clock)
    await t.apply(ev.Reconfigure(job_id="j", epoch=2, gpus=refs(1), effective_at=0.0))  # start: free
    clock.advance(100.0)  # 100 iterations at 1 it/s (linear curve)
    await t.apply(
        ev.Reconfigure(job_id="j", epoch=3, gpus=refs(2), effective_at=100.0)
    )  # scale-out: 30 s stop
    clock.advance(110.0)
    await t.apply(ev.Reconfigure(job_id="j", epoch=4, gpus=refs(4), effective_at=110.0))  # cancels epoch 3
    await t.apply(ev.Reconfigure(job_id="j", epoch=3, gpus=refs(1), effective_at=110.0))  # stale: ignored
    assert t.epoch == 4 and t.world == 4
    cancelled = await events_of(bus, ev.ReconfigurationCancelled)
    assert [(c.epoch, c.by_epoch) for c in cancelled] == [(3, 4)]
    # No progress during the cancelled stop (100 -> 110), then a new 30 s stop from 110.
    assert t.iteration_at(110.0) == pytest.approx(100.0)
    assert t.iteration_at(140.0) == pytest.approx(100.0)
    assert t.iteration_at(150.0) == pytest.approx(100.0 + 4 * 10.0)
    # The job finishes exactly when its remaining 900 iterations are done at 4 it/s.
    assert t.finish_at() == pytest.approx(140.0 + 900 / 4)
    started = await events_of(bus, ev.ReconfigurationStarted)
    assert [(s.epoch, s.kind) for s in started] == [(2, "start"), (3, "scale_out"), (4, "scale_out")]


async def test_an_order_after_the_finish_instant_completes_the_job_first(bus: Bus) -> None:
    clock = ManualClock()
    t = await trainer(bus, clock)
    await t.apply(ev.Reconfigure(job_id="j", epoch=2, gpus=refs(2), effective_at=0.0))
    assert t.finish_at() == 500.0  # 1000 iterations at 2 it/s
    clock.advance(900.0)  # the process was late: the next order is stamped after the finish
    await t.apply(ev.Reconfigure(job_id="j", epoch=3, gpus=refs(1), effective_at=800.0))
    assert t.completed
    done = [e async for _, e in bus.replay() if isinstance(e.event, ev.JobCompleted)]
    assert [(e.at, e.event.iterations) for e in done] == [(500.0, 1000)]


async def test_an_order_at_the_instant_of_the_previous_one_replaces_it(bus: Bus) -> None:
    """Two orders stamped with one instant (a partial decision, then the full one): the
    job is charged one change, from the shape before that instant."""
    clock = ManualClock()
    t = await trainer(bus, clock)
    await t.apply(ev.Reconfigure(job_id="j", epoch=2, gpus=refs(2), effective_at=0.0))
    clock.advance(100.0)  # 200 iterations at 2 it/s
    await t.apply(ev.Reconfigure(job_id="j", epoch=3, gpus=refs(4), effective_at=100.0))  # scale-out
    clock.advance(101.0)
    # Replaced at the same instant: 2 GPUs as before it, so no change at all ...
    await t.apply(ev.Reconfigure(job_id="j", epoch=4, gpus=refs(2), effective_at=100.0))
    assert t.world == 2 and t.in_flight is None
    assert t.iteration_at(110.0) == pytest.approx(200.0 + 2 * 10.0)
    # ... and at the next instant a change counts from the shape then (2 -> 1).
    await t.apply(ev.Reconfigure(job_id="j", epoch=5, gpus=refs(1), effective_at=101.0))
    started = await events_of(bus, ev.ReconfigurationStarted)
    assert [(s.epoch, s.kind, s.from_world) for s in started] == [
        (2, "start", 0),
        (3, "scale_out", 2),
        (5, "scale_in", 2),
    ]


async def until_logged(bus: Bus, kind: type, count: int, timeout_s: float = 10.0) -> list[Any]:
    """The log's events of ``kind`` once there are at least ``count`` of them (polled)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(found := await events_of(bus, kind)) < count:
        assert asyncio.get_running_loop().time() < deadline, f"fewer than {count} {kind.__name__}"
        await asyncio.sleep(0.02)
    return found


async def test_a_job_moved_at_the_instant_it_started_starts_on_its_new_node(bus: Bus) -> None:
    """A job started on node n0 at t=10 and, by the rest of a same-instant burst, moved
    to n1 at t=10 was never running before t=10: its new leader starts it (no stop
    time), as the simulator's one decision at t=10 does. The old leader's periodic
    report must not claim otherwise: it makes none at the instant its shape began."""
    clock = ManualClock()
    clock.advance(10.0)
    a = await trainer(bus, clock)
    a.reports = ReportBackoff(0.001)
    b = EmulatedTrainer(bus, "j", "n1", clock=clock, costs=get_costs("migrate=30,scale_out=30,scale_in=30"))
    await b.load()
    stop = asyncio.Event()
    running = asyncio.create_task(a.run(stop))
    await a.commands.put(ev.Reconfigure(job_id="j", epoch=2, gpus=refs(1), effective_at=10.0))
    await until_logged(bus, ev.ReconfigurationStarted, 1)  # a applied epoch 2 (slow under load)
    await asyncio.sleep(0.1)  # a leads and would report every millisecond
    on_n1 = (ev.GpuRef(node_id="n1", index=0),)
    await a.commands.put(ev.Reconfigure(job_id="j", epoch=3, gpus=on_n1, effective_at=10.0))
    await b.apply(ev.Reconfigure(job_id="j", epoch=3, gpus=on_n1, effective_at=10.0))
    stop.set()
    await running
    reports = await events_of(bus, ev.ProgressReported)
    assert all(r.num_gpus == 0 for r in reports), reports
    started = [(s.epoch, s.kind, s.from_world) for s in await events_of(bus, ev.ReconfigurationStarted)]
    assert started == [(2, "start", 0), (3, "start", 0)]
    assert b.is_leader and b.finish_at() == 10.0 + 1000.0  # no stop time charged


async def test_the_profilers_model_is_not_taken_for_the_jobs_truth(bus: Bus) -> None:
    # A job with no profile and no catalog runs at linear scaling; what the profiler
    # published about it (AFS §4.5's estimate) must not become how fast it runs, or the
    # overestimate would come true. A trace's table still is the truth.
    spec = ev.JobSpec(user="u", min_gpus=1, max_gpus=4, requested_gpus=2, total_iterations=1000)
    await bus.publish(codec.wrap(ev.JobSubmitted(job_id="j", spec=spec), at=0.0))
    guess = {k: 5.0 * k for k in range(1, 5)}
    await bus.publish(
        ev.ThroughputModelUpdated(
            job_id="j", gpu_type="", model_kind="afs-overestimate", throughput=guess, overestimated=True
        )
    )
    t = EmulatedTrainer(bus, "j", "n0", clock=ManualClock(), costs=get_costs("free"))
    await t.load()
    assert t.curve == (0.0, 1.0, 2.0, 3.0, 4.0)
    await bus.publish(
        ev.ThroughputModelUpdated(job_id="j", gpu_type="", model_kind="table", throughput=guess)
    )
    await t.load()
    assert t.curve[1:] == (5.0, 10.0, 15.0, 20.0)


async def test_periodic_reports_back_off_and_start_over_at_each_change(bus: Bus) -> None:
    """The periodic ``ProgressReported`` interval doubles from ``report_every_s`` up to
    ``report_max_every_s`` and starts over when a reconfiguration completes
    (:mod:`shoal.reporting`); with no maximum it stays fixed, as before."""

    async def reports_in(
        window_s: float, max_every_s: float | None, change_at_s: float | None = None
    ) -> list[float]:
        clock = ManualClock()
        spec = ev.JobSpec(user="u", min_gpus=1, max_gpus=4, requested_gpus=2, total_iterations=10**9)
        job = f"j{len(await events_of(bus, ev.JobSubmitted))}"
        await bus.publish(codec.wrap(ev.JobSubmitted(job_id=job, spec=spec), at=0.0))
        t = EmulatedTrainer(
            bus,
            job,
            "n0",
            clock=clock,
            costs=get_costs("free"),
            report_every_s=0.02,
            report_max_every_s=max_every_s,
        )
        await t.load()
        stop = asyncio.Event()
        running = asyncio.create_task(t.run(stop))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await t.commands.put(ev.Reconfigure(job_id=job, epoch=2, gpus=refs(1), effective_at=0.0))
        changed = False
        while (elapsed := loop.time() - t0) < window_s:
            clock.advance(elapsed * 100)  # virtual time moves on, so reports are due
            if change_at_s is not None and not changed and elapsed >= change_at_s:
                changed = True
                await t.commands.put(
                    ev.Reconfigure(job_id=job, epoch=3, gpus=refs(2), effective_at=clock.now())
                )
            await asyncio.sleep(0.005)
        stop.set()
        await running
        return [
            e.at
            for _, e in [x async for x in bus.replay()]
            if isinstance(e.event, ev.ProgressReported) and e.event.job_id == job
        ]

    fixed = await reports_in(1.6, None)
    backoff = await reports_in(1.6, 0.32)
    # Fixed 20 ms: about 80 reports in 1.6 s. Backoff: 20, 40, 80, 160, 320, 320, ... ms:
    # 4 reports in the first 0.3 s, then one per 0.32 s (about 8 in all).
    assert len(fixed) >= 40, len(fixed)
    assert 5 <= len(backoff) <= 11, len(backoff)
    # A change of shape at 1.0 s starts the intervals over: more reports after it than
    # in the same stretch without one.
    changed = await reports_in(1.6, 0.32, change_at_s=1.0)
    assert len([at for at in changed if at >= 100.0]) > len([at for at in backoff if at >= 100.0]), (
        changed,
        backoff,
    )


async def test_a_report_comes_when_the_measurement_window_ends(bus: Bus) -> None:
    """With ``measure_window_s`` the leader reports at the profiler's window end of its
    new shape (whole seconds from the ``ReconfigurationCompleted`` stamp) though its
    backed-off interval is long by then: the profiler, which holds a shared clock there,
    needs a report made at or after that instant."""
    clock = ManualClock()
    clock.advance(5.0)
    spec = ev.JobSpec(user="u", min_gpus=1, max_gpus=4, requested_gpus=1, total_iterations=10**9)
    await bus.publish(codec.wrap(ev.JobSubmitted(job_id="w", spec=spec), at=0.0))
    t = EmulatedTrainer(
        bus,
        "w",
        "n0",
        clock=clock,
        costs=get_costs("free"),
        report_every_s=0.02,
        report_max_every_s=10.0,
        measure_window_s=30.0,
    )
    await t.load()
    stop = asyncio.Event()
    running = asyncio.create_task(t.run(stop))
    try:
        await t.commands.put(ev.Reconfigure(job_id="w", epoch=2, gpus=refs(1), effective_at=5.0))
        for step in range(20):  # 2 s of wall time, virtual time creeping towards 34
            clock.advance(5.0 + step)
            await asyncio.sleep(0.1)
        assert t.reports.interval_s >= 0.64, "backed off by now"
        assert t.reports.window_at == 35.0  # ceil(5 + 0 + 30)
        before = len(await events_of(bus, ev.ProgressReported))
        clock.advance(35.0)  # held there, as the profiler holds a shared clock
        # The trainer wakes at least every 0.5 s of wall time: the first report after the
        # advance (however late a loaded machine makes it) must be the window's only one.
        reports = await until_logged(bus, ev.ProgressReported, before + 1)
        assert len(reports) == before + 1, "one report at the window's end, not at the next interval"
        assert t.reports.window_at is None
    finally:
        stop.set()
        await running
    at = [e.at async for _, e in bus.replay() if isinstance(e.event, ev.ProgressReported)]
    assert at[-1] == 35.0

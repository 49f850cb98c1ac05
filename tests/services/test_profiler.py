"""profiler against a real nats-server: progress in, models out, at a bounded rate."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import pytest
import structlog.testing
from shoal import events as ev
from shoal.bus import Bus
from shoal.profiling import OVERESTIMATE_KIND
from shoal.profiling.speed import MODEL_KIND
from shoal_services.profiler.service import ProfilerService

pytestmark = pytest.mark.integration


class ManualClock:
    """Virtual time that moves only when the test says so."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(0)


def submitted(job_id: str, max_gpus: int = 8, **spec: Any) -> ev.JobSubmitted:
    return ev.JobSubmitted(
        job_id=job_id, spec=ev.JobSpec(user="alice", min_gpus=1, max_gpus=max_gpus, requested_gpus=1, **spec)
    )


def report(job_id: str, gpus: int, rate: float, iteration: int = 10, **kw: Any) -> ev.ProgressReported:
    return ev.ProgressReported(job_id=job_id, iteration=iteration, num_gpus=gpus, samples_per_s=rate, **kw)


def speed(w: int) -> float:
    """A known all-reduce speed function: T(w) = 0.4/w + 0.05 + 0.02·w (s/iteration)."""
    return 1.0 / (0.4 / w + 0.05 + 0.02 * w)


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def updates(bus: Bus) -> list[ev.ThroughputModelUpdated]:
    return [e.event async for _, e in bus.replay() if isinstance(e.event, ev.ThroughputModelUpdated)]


async def start(service: ProfilerService) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await wait_until(lambda: service.is_leader)
    return stop, task


async def test_overestimate_first_then_fit(bus: Bus) -> None:
    prof = ProfilerService(bus, holder="p1", clock=ManualClock(), min_interval_s=0.0)
    await bus.publish(submitted("j", max_gpus=8))
    stop, task = await start(prof)
    try:
        await bus.publish(report("j", 2, speed(2)))
        await wait_until(lambda: prof.projection.state.jobs["j"].throughput_models.get("") is not None)
        first = prof.projection.state.jobs["j"].throughput_models[""]
        # AFS §4.5: measured at 2 GPUs, linear scaling everywhere else.
        assert first.overestimated and first.model_kind == OVERESTIMATE_KIND
        assert dict(first.throughput) == pytest.approx({k: speed(2) * k / 2 for k in range(1, 9)})
        for w in (1, 4):
            await bus.publish(report("j", w, speed(w)))
        await wait_until(
            lambda: prof.projection.state.jobs["j"].throughput_models[""].model_kind == MODEL_KIND
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    fitted = prof.projection.state.jobs["j"].throughput_models[""]
    assert not fitted.overestimated
    assert fitted.params[1:] == pytest.approx((0.05, 0.0, 0.02), rel=1e-6)
    curve = dict(fitted.throughput)
    for w in range(1, 9):
        assert curve[w] == pytest.approx(speed(w), rel=1e-6)
    log = await updates(bus)
    # The two later reports may be coalesced into one pass: two or three updates.
    kinds = [u.model_kind for u in log]
    assert kinds[0] == OVERESTIMATE_KIND and kinds[-1] == MODEL_KIND and len(kinds) in (2, 3)


async def test_a_newly_measured_count_is_published_even_when_the_estimate_had_it_right(bus: Bus) -> None:
    # AFS §4.5: the allocator moves a job to its next smaller unit when the measurement
    # at the current one arrives, so a count measured for the first time must reach the
    # log even though linear scaling from 4 GPUs had already predicted its value.
    prof = ProfilerService(bus, holder="p1", clock=ManualClock(), min_interval_s=0.0)
    await bus.publish(submitted("j", max_gpus=4))
    stop, task = await start(prof)
    try:
        await bus.publish(report("j", 4, 8.0))
        await wait_until(lambda: prof.published == 1)
        first = prof.projection.state.jobs["j"].throughput_models[""]
        assert first.measured == (4,) and dict(first.throughput)[2] == pytest.approx(4.0)
        await bus.publish(report("j", 2, 4.0))  # exactly the estimate
        await wait_until(lambda: prof.projection.state.jobs["j"].throughput_models[""].measured == (2, 4))
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    log = await updates(bus)
    assert [u.measured for u in log] == [(4,), (2, 4)]
    assert all(u.overestimated for u in log)


async def test_updates_are_rate_limited_and_only_on_material_change(bus: Bus) -> None:
    clock = ManualClock()
    prof = ProfilerService(bus, holder="p1", clock=clock, min_interval_s=100.0, material_change=0.05)
    await bus.publish(submitted("j", max_gpus=1))
    stop, task = await start(prof)
    try:
        await bus.publish(report("j", 1, 10.0))
        await wait_until(lambda: len(prof.projection.state.jobs["j"].throughput_models) == 1)
        # Noise below 5 %: nothing to publish, ever.
        r = await bus.publish(report("j", 1, 10.2))
        await wait_until(lambda: prof.projection.last_seq >= r.seq and not prof.book.dirty_models)
        assert not prof.held_back
        # A real change, too soon: held back until 100 s after the first update.
        for rate in (20.0, 21.0, 20.5):
            r = await bus.publish(report("j", 1, rate))
        await wait_until(lambda: prof.projection.last_seq >= r.seq and ("model", "j/") in prof.held_back)
        assert prof.held_back[("model", "j/")] == clock.t + 100.0
        assert len(await updates(bus)) == 1
        clock.t += 100.0
        await bus.publish(report("j", 1, 20.5, iteration=20))  # the next report finds it due
        await wait_until(
            lambda: len(prof.projection.state.jobs["j"].throughput_models) == 1 and prof.published == 2
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    log = await updates(bus)
    assert len(log) == 2
    # Gandiva_fair §3.5: the change was detected and the old samples dropped.
    assert log[1].throughput[1] == pytest.approx((20.0 + 21.0 + 20.5 + 20.5) / 4)


async def test_restart_replays_and_does_not_duplicate(bus: Bus) -> None:
    clock = ManualClock()
    await bus.publish(submitted("j", max_gpus=4, convergence_target=0.35))
    first = ProfilerService(bus, holder="p1", clock=clock, min_interval_s=0.0)
    stop, task = await start(first)
    beta = (0.02, 0.5, 0.3)
    try:
        for i, k in enumerate(range(0, 400, 20)):
            loss = 1.0 / (beta[0] * k + beta[1]) + beta[2]
            await bus.publish(report("j", 1 + i % 2, speed(1 + i % 2), iteration=k, loss=loss))
        await wait_until(lambda: first.projection.state.jobs["j"].convergence is not None)
        await wait_until(lambda: not first.book.dirty_models and not first.book.dirty_convergence)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    before = await updates(bus)
    conv = first.projection.state.jobs["j"].convergence
    assert conv is not None
    true_total = (1 / (0.35 - beta[2]) - beta[1]) / beta[0]
    assert conv.estimated_total_iterations == pytest.approx(true_total, rel=0.02)

    second = ProfilerService(bus, holder="p2", clock=clock, min_interval_s=0.0)
    stop, task = await start(second)
    try:
        await wait_until(lambda: second.passes >= 1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert second.book.measured("j", "") == first.book.measured("j", "")
    assert second.published == 0
    assert len(await updates(bus)) == len(before)


async def test_racing_profilers_propose_the_same_id_and_nats_dedups(bus: Bus) -> None:
    await bus.publish(submitted("j"))
    r = await bus.publish(report("j", 2, 8.0))
    a = ProfilerService(bus, holder="a", clock=ManualClock(5.0))
    b = ProfilerService(bus, holder="b", clock=ManualClock(6.0))
    for p in (a, b):
        await p.projection.start()
        await p.projection.wait_for(r.seq)
    try:
        (env_a,) = a.plan(5.0)
        (env_b,) = b.plan(6.0)
        assert env_a.id == env_b.id
        assert not (await bus.publish(env_a)).duplicate
        assert (await bus.publish(env_b)).duplicate
    finally:
        await a.projection.stop()
        await b.projection.stop()
    assert len(await updates(bus)) == 1


async def test_standby_does_not_publish(bus: Bus) -> None:
    await bus.publish(submitted("j"))
    leader = ProfilerService(bus, holder="p1", clock=ManualClock(), min_interval_s=0.0)
    standby = ProfilerService(bus, holder="p2", clock=ManualClock(), min_interval_s=0.0)
    stop1, t1 = await start(leader)
    stop2 = asyncio.Event()
    t2 = asyncio.create_task(standby.run(stop2))
    try:
        for w in (1, 2, 4):
            r = await bus.publish(report("j", w, speed(w)))
        await wait_until(lambda: standby.projection.last_seq >= r.seq and leader.published >= 1)
        await wait_until(lambda: not leader.book.dirty_models)
        assert not standby.is_leader and standby.published == 0
    finally:
        stop1.set()
        stop2.set()
        await asyncio.wait_for(asyncio.gather(t1, t2), 15)
    assert {u.job_id for u in await updates(bus)} == {"j"}


async def test_nonsense_progress_is_ignored_with_a_reason(bus: Bus) -> None:
    prof = ProfilerService(bus, holder="p1", clock=ManualClock(), min_interval_s=0.0)
    await bus.publish(submitted("j", max_gpus=4))
    stop, task = await start(prof)
    try:
        with structlog.testing.capture_logs() as captured:
            await bus.publish(report("j", 2, 6.0))
            await wait_until(lambda: prof.published == 1)
            good = prof.projection.state.jobs["j"].throughput_models[""]
            await bus.publish(report("j", 2, math.inf))
            await bus.publish(report("j", 2, 6.0, loss=math.nan))
            await bus.publish(report("j", 2, 6.0, loss=-3.0))
            await bus.publish(report("j", 64, 6.0))
            await bus.publish(report("j", 2, 1e12))
            await bus.publish(report("nobody", 2, 6.0))
            await bus.publish(ev.ProgressReported(job_id="j", iteration=11, num_gpus=2, step_time_s=math.inf))
            # A negative rate violates the contract: readers skip it as malformed.
            await bus.publish(report("j", 2, -5.0))
            r = await bus.publish(report("j", 2, 0.0, iteration=11))
            await wait_until(lambda: prof.projection.last_seq >= r.seq and not prof.book.dirty_models)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    warned = [
        e["reasons"] for e in captured if e["event"] == "progress_rejected" and e["log_level"] == "warning"
    ]
    assert ["implausible_rate"] in warned and ["unknown_job"] in warned
    assert prof.rejected == {
        "nonfinite_rate": 2,
        "nonfinite_loss": 1,
        "negative_loss": 1,
        "gpus_over_max": 1,
        "implausible_rate": 1,
        "unknown_job": 1,
        "no_rate": 1,
    }
    assert bus.stats.malformed_skipped >= 1
    # The two reports whose loss was bad still measured the rate (6.0): the model is unchanged.
    assert prof.book.measured("j", "") == {2: 6.0}
    assert prof.projection.state.jobs["j"].throughput_models[""] == good
    assert len(await updates(bus)) == 1


async def test_a_hand_over_report_is_filed_under_the_generation_the_job_left(bus: Bus) -> None:
    # Gandiva_fair §3.4-3.5: a trade moves a job from a K80 to a V100. The decision gives
    # the job its new generation at once, but the old leader's hand-over report (the
    # emulated trainer names no gpu_type) still measures the K80. Filed under the V100,
    # it made the buyer's jobs look heterogeneous there, and the trader undid the trade.
    prof = ProfilerService(bus, holder="p1", clock=ManualClock(), min_interval_s=0.0)
    await bus.publish(submitted("j", max_gpus=1))
    stop, task = await start(prof)

    def measured() -> dict[str, dict[int, float]]:
        return {g: prof.book.measured("j", g) for g in ("K80", "V100") if prof.book.measured("j", g)}

    try:
        await bus.publish(ev.SharesDecided(epoch=1, shares={"j": 1}, gpu_types={"j": "K80"}))
        await bus.publish(ev.ReconfigurationCompleted(job_id="j", epoch=1, world_size=1))
        await bus.publish(report("j", 1, 1.0, iteration=10, epoch=1))
        await wait_until(lambda: measured() == {"K80": {1: 1.0}})
        await bus.publish(ev.SharesDecided(epoch=2, shares={"j": 1}, gpu_types={"j": "V100"}))
        r = await bus.publish(report("j", 1, 1.0, iteration=20, epoch=1))  # the hand-over
        await wait_until(lambda: prof.projection.last_seq >= r.seq)
        assert prof.projection.state.jobs["j"].gpu_type == "V100"
        assert measured() == {"K80": {1: 1.0}}, "the K80's rate was filed under the V100"
        assert prof.book.samples("j", "K80") == 2
        await bus.publish(ev.ReconfigurationCompleted(job_id="j", epoch=2, world_size=1))
        await bus.publish(report("j", 1, 3.0, iteration=30, epoch=2))
        await wait_until(lambda: measured() == {"K80": {1: 1.0}, "V100": {1: 3.0}})
        # A report that names its generation is filed there, whatever the job's history.
        r = await bus.publish(report("j", 1, 1.0, iteration=40, epoch=2, gpu_type="K80"))
        await wait_until(lambda: prof.book.samples("j", "K80") == 3)
        assert prof.book.samples("j", "V100") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    models = {u.gpu_type: dict(u.throughput) for u in await updates(bus)}
    assert models["V100"][1] == pytest.approx(3.0) and models["K80"][1] == pytest.approx(1.0)


async def test_main_serves_from_settings_until_stopped(bus: Bus, nats_url: str, prefix: str) -> None:
    from shoal.settings import Settings
    from shoal_services.profiler.main import serve

    settings = Settings.load(
        env={"SHOAL_NATS_URL": nats_url, "NATS_CREDS": os.environ["NATS_CREDS"], "SHOAL_PREFIX": prefix}
    )
    await bus.publish(submitted("j", max_gpus=2))
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    try:
        await bus.publish(report("j", 1, 4.0))
        seen: list[ev.ThroughputModelUpdated] = []
        deadline = asyncio.get_running_loop().time() + 10
        while not seen:
            assert asyncio.get_running_loop().time() < deadline, "no model published"
            seen = await updates(bus)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert seen[0].throughput == {1: 4.0, 2: 8.0} and seen[0].overestimated


async def test_profiler_measures_the_emulated_trainer(bus: Bus, nats_url: str) -> None:
    """End to end with the emulated stack: sidecars report progress at the catalog
    curve; the profiler's measured count equals the truth and the rest is the §4.5
    overestimate scaled from it."""
    from shoal.models import get_catalog
    from shoal.workloads import TraceJob
    from shoal_services.stack import EmulatedStack, StackConfig, replay_trace

    from tests.services.test_allocator_placer import GreedyRequested

    truth = get_catalog("afs").curves["GooglenetModel128"][""].throughput
    stack = EmulatedStack(
        bus,
        nats_url,
        GreedyRequested(),
        StackConfig(nodes=1, gpus_per_node=4, time_scale=100.0, catalog="afs", heartbeat_s=0.5),
    )
    prof = ProfilerService(bus, holder="p1", clock=stack.clock, min_interval_s=0.0)
    await stack.start()
    stop = asyncio.Event()
    task = asyncio.create_task(prof.run(stop))
    try:
        spec = ev.JobSpec(
            user="u",
            model="GooglenetModel128",
            min_gpus=1,
            max_gpus=4,
            requested_gpus=2,
            total_iterations=2000,
        )
        job = TraceJob(
            job_id="g", spec=spec, submit_time_s=0.0, duration_s=2000 / truth[2], throughput=truth[:5]
        )
        await replay_trace(stack, [job], attach_profiles=False)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await stack.stop()
    log = await updates(bus)
    assert log, "the profiler published nothing"
    last = log[-1]
    assert last.model_kind == OVERESTIMATE_KIND and last.overestimated
    assert last.throughput[2] == pytest.approx(truth[2], rel=0.01)
    assert last.throughput[4] == pytest.approx(2 * truth[2], rel=0.01)
    assert prof.rejected.get("nonfinite_rate", 0) == 0

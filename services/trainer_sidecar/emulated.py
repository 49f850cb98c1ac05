"""The emulated trainer: a sidecar that advances a job at its modelled throughput.

It obeys the same ``Reconfigure`` orders as the real sidecar will, so the node
daemon treats both alike:

* an order for an epoch at or below the newest one seen is stale and ignored;
* a newer order while a reconfiguration is in flight cancels it
  (``ReconfigurationCancelled``, CoDDL §4.3) and starts the new one;
* the stop time of each change comes from the cost model
  (:mod:`shoal.sim.costs`, shared with the simulator), in virtual seconds.

Progress is continuous at ``curve[world_size]`` iterations per virtual second (the
job's catalog curve for ``spec.model``, else linear scaling). The trainer computes
the exact virtual instant the job finishes and wakes for it, so completion times
do not depend on a polling period.

Leadership (emulated mode): of the job's sidecars, the one on the node that holds
the job's lowest ``GpuRef`` drives it: it advances, reports and completes; the
others only hold the GPUs. A new leader resumes from the newest
``ProgressReported`` in the log, so at most one report interval of progress is
redone when leadership moves (the real sidecar elects a leader in KV instead).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats.js.errors
import structlog
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus, ConcurrencyConflict
from shoal.clock import Clock
from shoal.models import Catalog
from shoal.sim.costs import ReconfigCosts, classify

log = structlog.get_logger("shoal.sidecar")


class EmulatedTrainer:
    def __init__(
        self,
        bus: Bus,
        job_id: str,
        node_id: str,
        *,
        clock: Clock,
        costs: ReconfigCosts,
        catalog: Catalog | None = None,
        report_every_s: float = 0.25,
    ) -> None:
        self.bus = bus
        self.job_id = job_id
        self.node_id = node_id
        self.clock = clock
        self.costs = costs
        self.catalog = catalog
        self.report_every_s = report_every_s
        self.commands: asyncio.Queue[ev.Reconfigure] = asyncio.Queue()
        self.spec: ev.JobSpec | None = None
        self.curve: tuple[float, ...] = (0.0, 1.0)
        self.epoch = 0
        self.gpus: tuple[ev.GpuRef, ...] = ()
        self.iteration = 0.0
        self.stopped_until = 0.0
        self.in_flight: tuple[int, float, float] | None = None
        """(epoch, started at, stop time) of the reconfiguration under way."""
        self.completed = False
        self._last_progress_at = 0.0
        self._last_report_wall = 0.0

    @property
    def world(self) -> int:
        return len(self.gpus)

    @property
    def is_leader(self) -> bool:
        return bool(self.gpus) and min(self.gpus).node_id == self.node_id

    async def _last_event(self, name: str) -> ev.Event | None:
        subject = f"{self.bus.names.prefix}.job.{self.job_id}.{name}"
        try:
            raw = await self.bus.js.get_last_msg(self.bus.names.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        return codec.decode(raw.data or b"").event

    async def load(self) -> None:
        submitted = await self._last_event("submitted")
        if not isinstance(submitted, ev.JobSubmitted):
            raise RuntimeError(f"job {self.job_id} has no JobSubmitted in the log")
        self.spec = submitted.spec
        want = self.spec.max_gpus
        curve: tuple[float, ...] | None = None
        if self.catalog is not None and self.spec.model in self.catalog.curves:
            by_type = self.catalog.curves[self.spec.model]
            curve = by_type[sorted(by_type)[0]].throughput
        if curve is None:
            curve = tuple(float(k) for k in range(want + 1))
        if len(curve) <= want:
            curve = curve + (curve[-1],) * (want + 1 - len(curve))
        self.curve = curve
        await self._resume_progress()

    async def _resume_progress(self) -> None:
        progress = await self._last_event("progress")
        if isinstance(progress, ev.ProgressReported):
            self.iteration = max(self.iteration, float(progress.iteration))
        done = await self._last_event("completed")
        self.completed = done is not None

    def rate(self) -> float:
        if not self.world or self.world >= len(self.curve):
            return self.curve[-1] if self.world else 0.0
        return self.curve[self.world]

    def _advance(self, now: float) -> None:
        start = max(self._last_progress_at, self.stopped_until)
        if self.world and now > start and not self.completed:
            self.iteration += self.rate() * (now - start)
        self._last_progress_at = max(self._last_progress_at, now)

    async def _publish(self, event: ev.Event, **kw: object) -> None:
        await self.bus.publish(codec.wrap(event, at=self.clock.now()), **kw)  # type: ignore[arg-type]

    async def apply(self, cmd: ev.Reconfigure) -> None:
        """Handle one order (see the module docstring)."""
        now = self.clock.now()
        if cmd.epoch <= self.epoch:
            log.info("stale_order_ignored", job_id=self.job_id, epoch=cmd.epoch, newest=self.epoch)
            return
        was_leader = self.is_leader
        self._advance(now)
        old_world, old_gpus = self.world, self.gpus
        if self.in_flight is not None and was_leader:
            await self._publish(
                ev.ReconfigurationCancelled(
                    job_id=self.job_id, epoch=self.in_flight[0], by_epoch=cmd.epoch, reason="superseded"
                )
            )
            self.in_flight = None
        if was_leader and old_world:
            await self._report(now)
        self.epoch = cmd.epoch
        self.gpus = tuple(sorted(cmd.gpus))
        if self.is_leader and not was_leader:
            await self._resume_progress()
            self._last_progress_at = now
        kind = classify(old_world, self.world, set(old_gpus) != set(self.gpus))
        if not self.is_leader or kind is None:
            return
        stop = self.costs.stop_time(kind)
        await self._publish(
            ev.ReconfigurationStarted(
                job_id=self.job_id, epoch=cmd.epoch, kind=kind, from_world=old_world, to_world=self.world
            )
        )
        self.stopped_until = now + stop
        self.in_flight = (cmd.epoch, now, stop)
        if stop == 0:
            await self._finish_reconfiguration(now)

    async def _finish_reconfiguration(self, now: float) -> None:
        if self.in_flight is None:
            return
        epoch, started, stop = self.in_flight
        self.in_flight = None
        await self._publish(
            ev.ReconfigurationCompleted(
                job_id=self.job_id,
                epoch=epoch,
                world_size=self.world,
                gpus=self.gpus,
                stop_time_s=stop,
                duration_s=max(0.0, now - started),
            )
        )

    async def _report(self, now: float) -> None:
        if self.spec is None:
            return
        self._last_report_wall = asyncio.get_running_loop().time()
        await self._publish(
            ev.ProgressReported(
                job_id=self.job_id,
                iteration=int(self.iteration),
                samples_per_s=self.rate() * max(1, self.spec.global_batch_size),
                num_gpus=self.world,
                epoch=self.epoch,
            )
        )

    def _seconds_to_next_wake(self, now: float) -> float:
        """Wall seconds until something is due: the end of a stop, completion or a report."""
        waits = [self.report_every_s]
        scale = getattr(self.clock, "scale", 1.0)
        if self.in_flight is not None:
            waits.append((self.stopped_until - now) / scale)
        if self.is_leader and self.world and self.spec and self.spec.total_iterations and not self.completed:
            start = max(now, self.stopped_until)
            remaining = self.spec.total_iterations - self.iteration
            rate = self.rate()
            if rate > 0:
                waits.append((start - now + remaining / rate) / scale)
        return max(0.0, min(waits))

    async def run(self, stop: asyncio.Event) -> None:
        await self.load()
        loop = asyncio.get_running_loop()
        while not stop.is_set() and not self.completed:
            now = self.clock.now()
            with contextlib.suppress(TimeoutError):
                cmd = await asyncio.wait_for(self.commands.get(), self._seconds_to_next_wake(now))
                await self.apply(cmd)
                continue
            now = self.clock.now()
            if not self.is_leader:
                continue
            self._advance(now)
            if self.in_flight is not None and now >= self.stopped_until:
                await self._finish_reconfiguration(now)
            total = self.spec.total_iterations if self.spec else None
            if total is not None and self.iteration >= total - 1e-6:
                self.iteration = float(total)
                await self._report(now)
                try:
                    await self._publish(
                        ev.JobCompleted(job_id=self.job_id, iterations=total), expected_last_subject_seq=0
                    )
                except ConcurrencyConflict:
                    pass  # another sidecar of this job completed it first
                self.completed = True
                log.info("job_completed", job_id=self.job_id, iterations=total)
            elif self.world and loop.time() - self._last_report_wall >= self.report_every_s:
                await self._report(now)


def parse_order(line: bytes) -> ev.Reconfigure:
    """One order from the node daemon: a JSON ``Reconfigure`` per line.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: a malformed order.
    """
    return msgspec.json.decode(line, type=ev.Reconfigure)

"""The emulated trainer: a sidecar that advances a job at its modelled throughput.

It obeys the same ``Reconfigure`` orders as the real sidecar will, so the node
daemon treats both alike:

* an order for an epoch at or below the newest one seen is stale and ignored;
* a newer order while a reconfiguration is in flight cancels it
  (``ReconfigurationCancelled``, CoDDL §4.3) and starts the new one;
* the stop time of each change comes from the cost model
  (:mod:`shoal.sim.costs`, shared with the simulator), in virtual seconds.

Progress is continuous at ``curve[world_size]`` iterations per virtual second. The
curve is the one of this node's GPU generation (``gpu_type``, from the node daemon),
as the simulator runs a job on a heterogeneous cluster at its curve for the generation
it is placed on: the job's published model for that generation (or for none), else its
spec's ``profile`` for it (else the profile's reference ``""``), else the catalog's for
``spec.model`` on that generation (case-insensitive, else the catalog's first), else
linear scaling. (Progress reports leave the generation out: the profiler takes the
job's from its share, so that a homogeneous cluster's models stay under ``""``.) A gang
that spans generations runs at its leader's (its lowest node's); the policies place a
gang on one generation. The trainer computes
the exact virtual instant the job finishes and wakes for it, so completion times
do not depend on a polling period.

A job of unknown length (``convergence_target``) has no real loss here, so the
trainer gives it one: Optimus eq. (1) through
:func:`shoal.profiling.convergence.curve_reaching`, reaching the target after
``SHOAL_TRAIN_EMULATED_ITERATIONS`` iterations from the job's ``env`` (default
:data:`CONVERGENCE_ITERATIONS`). Every progress report carries the loss at its
iteration (the profiler fits it and publishes ``ConvergenceEstimated``), and the job
completes when the loss reaches the target.

Timing at a high time scale. At 1000× a 30 ms control-plane path (allocator →
placer → node daemon → this process, plus spawning the process) would be 30
virtual seconds per change, an artefact of emulation and not of the scheduler. So
an order applies as of its ``effective_at`` (the instant the allocator decided it,
carried on ``Reconfigure``): progress under the old shape is counted up to that
instant, the cost model's stop time runs from it, and the events are stamped with
it. The job completes at its exact virtual finish instant, rounded up to a whole
second as in the simulator, and ``JobCompleted`` carries that instant. This is what
makes emulate-mode runs agree with ``shoal simulate`` (the conformance test).

On a synchronized clock (:class:`shoal.clock.SharedClock`, ``--clock-file``) the
leading trainer also holds the clock at its finish instant, so virtual time cannot
pass the completion before it is published; the completion goes out under a hold
the allocator releases, and each order is released (``order:<epoch>:<node>:<job>``)
only once it is applied and the new finish instant is held. Orders then arrive at
their decision instant exactly, and the catch-up above has nothing to repair.

Orders at one instant. An order applied at the same virtual instant as the one
before it replaces it: the earlier shape was in force for no time, so the stop time
and the kind of change (start, scale-out, move …) are those from the shape before
that instant. Without this, an allocator that decided on the first arrivals of a
same-second burst and then on all of them charged jobs two reconfigurations where
the simulator charges one.

Leadership (emulated mode): of the job's sidecars, the one on the node that holds
the job's lowest ``GpuRef`` drives it: it advances, reports and completes; the
others only hold the GPUs. A new leader resumes from the newest
``ProgressReported`` in the log, so at most one report interval (up to
``report_max_every_s``) of progress is redone when leadership moves (the real sidecar
elects a leader in KV instead).

Tracing: each order is a span ``sidecar.reconfigure`` that continues the trace the
node daemon sent with it (the ``traceparent`` field of the order line, see
:func:`parse_traced_order`), with a child span per phase: ``sidecar.stop`` (cancel a
superseded reconfiguration, hand the progress at the change instant over),
``sidecar.switch`` (take the new GPU set, and the job's progress when leadership
moved here) and ``sidecar.resume`` (the cost model's stop time, until training runs
again on the new shape). ``ReconfigurationStarted`` and ``ReconfigurationCompleted``
are published inside it, so their headers carry the trace on. The reconfigure span
ends with the reconfiguration (``shoal.outcome``: completed, superseded, stale,
follower, unchanged or unfinished).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from typing import TypeVar

import msgspec
import nats.js.errors
import structlog
from opentelemetry import trace
from opentelemetry.util.types import AnyValue
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus, ConcurrencyConflict
from shoal.clock import HOLD_TTL_S, Clock, SharedClock, done_key, hold, release
from shoal.log import bound_job
from shoal.models import Catalog, interpolate
from shoal.profiling import PROFILER_KINDS
from shoal.profiling.convergence import ConvergenceModel, curve_reaching
from shoal.reporting import ReportBackoff, measurement_window_end
from shoal.sim.costs import ReconfigCosts, classify
from shoal.telemetry import extract, trace_fields

_V = TypeVar("_V")

log = structlog.get_logger("shoal.sidecar")

CONVERGENCE_ITERATIONS = 1000
"""Iterations an emulated job with a ``convergence_target`` takes to reach it, unless its
``env`` sets ``SHOAL_TRAIN_EMULATED_ITERATIONS`` (choice: emulation has no real loss)."""


def _of_type(by_type: Mapping[str, _V], gpu_type: str, *, reference: bool = True) -> _V | None:
    """``by_type``'s entry for ``gpu_type`` (matched without case, as the simulator
    matches its inventory), else, with ``reference``, the reference entry ``""`` or the
    first; None when ``by_type`` is empty (or, without ``reference``, has no such type)."""
    if not by_type:
        return None
    if gpu_type:
        lower = {k.lower(): v for k, v in by_type.items()}
        if gpu_type.lower() in lower:
            return lower[gpu_type.lower()]
    if not reference:
        return None
    return by_type[""] if "" in by_type else by_type[sorted(by_type)[0]]


def emulated_loss_curve(spec: ev.JobSpec) -> ConvergenceModel:
    """The loss an emulated job with a ``convergence_target`` reports (module docstring)."""
    assert spec.convergence_target is not None
    try:
        n = float(spec.env.get("SHOAL_TRAIN_EMULATED_ITERATIONS", CONVERGENCE_ITERATIONS))
    except ValueError:
        n = float(CONVERGENCE_ITERATIONS)
    if not (math.isfinite(n) and n > 0):
        n = float(CONVERGENCE_ITERATIONS)
    return curve_reaching(spec.convergence_target, n)


_EPS = 1e-6
_DRAIN_S = 0.01
"""Wall seconds to wait for orders already in the pipe before acting on an overdue instant."""
_HANDOVER_WAIT_S = 0.5
"""Wall seconds a new leader waits for the previous leader's handover report."""


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
        report_max_every_s: float | None = None,
        measure_window_s: float | None = None,
        tracer: trace.Tracer | None = None,
        gpu_type: str = "",
    ) -> None:
        self.bus = bus
        self.gpu_type = gpu_type
        """This node's GPU generation ("" when unknown: the reference curve)."""
        self.tracer = tracer or trace.get_tracer("shoal.sidecar")
        self.order_context: dict[int, dict[str, str]] = {}
        """Epoch -> W3C fields that came with that order (set by the order reader)."""
        self._flight_spans: tuple[trace.Span, trace.Span] | None = None
        """(reconfigure, resume) spans of the reconfiguration in flight."""
        self.job_id = job_id
        self.node_id = node_id
        self.clock = clock
        self.costs = costs
        self.catalog = catalog
        self.reports = ReportBackoff(report_every_s, report_max_every_s)
        """The periodic reports' interval: ``report_every_s`` after each change of shape,
        doubling up to ``report_max_every_s`` (unset: a fixed interval; :mod:`shoal.reporting`)."""
        self.measure_window_s = measure_window_s
        """The profiler's measurement window (virtual seconds, ``SHOAL_PROFILER_MIN_INTERVAL_S``):
        a report is due at its end after each reconfiguration (None: no such report)."""
        self.commands: asyncio.Queue[ev.Reconfigure] = asyncio.Queue()
        self.spec: ev.JobSpec | None = None
        self.curve: tuple[float, ...] = (0.0, 1.0)
        self.loss_curve: ConvergenceModel | None = None
        """The emulated loss of a job with a ``convergence_target`` (see the module docstring)."""
        self.epoch = 0
        self.gpus: tuple[ev.GpuRef, ...] = ()
        self.iteration = 0.0
        self.stopped_until = 0.0
        """Progress resumes at this virtual instant (end of the current stop)."""
        self.segment_at = 0.0
        """Start of the current segment: ``iteration`` is the progress at that instant
        and progress is linear at ``rate()`` from ``stopped_until`` on."""
        self.in_flight: tuple[int, float, float] | None = None
        """(epoch, started at, stop time) of the reconfiguration under way."""
        self.completed = False
        self._last_report_wall = 0.0
        self._finish_held: float | None = None
        """The finish instant this process holds a synchronized clock at (leader only)."""
        self._prior: tuple[float, int, tuple[ev.GpuRef, ...]] | None = None
        """(instant, world, GPUs) of the newest change: the shape the job had just
        before the order applied at that instant."""

    @property
    def world(self) -> int:
        return len(self.gpus)

    @property
    def is_leader(self) -> bool:
        return bool(self.gpus) and min(self.gpus).node_id == self.node_id

    async def _last_envelope(self, name: str) -> ev.Envelope | None:
        subject = f"{self.bus.names.prefix}.job.{self.job_id}.{name}"
        try:
            raw = await self.bus.js.get_last_msg(self.bus.names.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        return codec.decode(raw.data or b"")

    async def _last_event(self, name: str) -> ev.Event | None:
        env = await self._last_envelope(name)
        return None if env is None else env.event

    async def load(self) -> None:
        submitted = await self._last_event("submitted")
        if not isinstance(submitted, ev.JobSubmitted):
            raise RuntimeError(f"job {self.job_id} has no JobSubmitted in the log")
        self.spec = submitted.spec
        want = self.spec.max_gpus
        if self.spec.convergence_target is not None and self.spec.total_iterations is None:
            self.loss_curve = emulated_loss_curve(self.spec)
        curve: tuple[float, ...] | None = None
        # The job's own throughput model in the log (a profile, or the calibrated
        # curve a trace replay published, as the simulator does) comes first. What the
        # profiler published is its *measurement* of this trainer (an estimate, a fit):
        # taking it for the truth would make the emulated job run as the profiler
        # guessed, so it is skipped (AFS §4.5's overestimate would come true).
        model = await self._last_event("profile.throughput_model_updated")
        profile = _of_type(self.spec.profile, self.gpu_type)
        if (
            isinstance(model, ev.ThroughputModelUpdated)
            and model.throughput
            and model.model_kind not in PROFILER_KINDS
            and model.gpu_type.lower() in ("", self.gpu_type.lower())
        ):
            curve = interpolate(dict(model.throughput), upto=want)
        elif profile is not None:
            curve = interpolate(dict(profile), upto=want)
        if curve is None and self.catalog is not None and self.spec.model in self.catalog.curves:
            by_type = self.catalog.curves[self.spec.model]
            typed = _of_type(by_type, self.gpu_type, reference=False)
            curve = (typed if typed is not None else by_type[sorted(by_type)[0]]).throughput
        if curve is None:
            curve = tuple(float(k) for k in range(want + 1))
        if len(curve) <= want:
            curve = curve + (curve[-1],) * (want + 1 - len(curve))
        self.curve = curve
        await self._resume_progress()

    async def _resume_progress(self, at: float | None = None) -> int:
        """Take over the job's progress from the log: the newest report, carried
        forward to ``at`` at the rate the job had then. Returns the number of GPUs
        the job ran on according to that report (0: it was not running).

        Whoever gave up the job reports the instant it did (see :meth:`apply`): a new
        leader waits up to ``_HANDOVER_WAIT_S`` for that report, which may still be on its
        way from the other process (on a synchronized clock, as long as a clock hold
        lives); the carry-over only bridges a report that never comes (a killed process)."""
        env = await self._last_envelope("progress")

        def running_before(env: ev.Envelope | None) -> bool:
            # The job ran somewhere until after its newest report: a handover is due.
            return (
                env is not None
                and isinstance(env.event, ev.ProgressReported)
                and env.event.num_gpus > 0
                and env.at < at - _EPS  # type: ignore[operator]
            )

        if at is not None:
            # On a synchronized clock the wait costs no virtual time (the order's hold
            # keeps the clock here), and a carry-over would make the run depend on how
            # loaded the machine is: wait as long as a hold lives.
            wait_s = (
                HOLD_TTL_S / 2 * self.clock.ttl_factor
                if isinstance(self.clock, SharedClock)
                else _HANDOVER_WAIT_S
            )
            deadline = asyncio.get_running_loop().time() + wait_s
            while running_before(env) and asyncio.get_running_loop().time() < deadline:
                if await self._last_event("completed") is not None:
                    break
                await asyncio.sleep(0.005)
                env = await self._last_envelope("progress")
        world = 0
        if env is not None and isinstance(env.event, ev.ProgressReported):
            done = float(env.event.iteration)
            world = env.event.num_gpus
            if at is not None and world and at > env.at:
                done += self.curve[min(world, len(self.curve) - 1)] * (at - env.at)
            total = self.total
            self.iteration = max(self.iteration, done if total is None else min(total, done))
        done_env = await self._last_event("completed")
        self.completed = done_env is not None
        return world

    def rate(self) -> float:
        if not self.world or self.world >= len(self.curve):
            return self.curve[-1] if self.world else 0.0
        return self.curve[self.world]

    @property
    def total(self) -> float | None:
        """Iterations until the job is done: its ``total_iterations``, or for a job with a
        ``convergence_target`` those at which the emulated loss reaches it."""
        if self.spec is None:
            return None
        if self.spec.total_iterations:
            return float(self.spec.total_iterations)
        if self.loss_curve is not None and self.spec.convergence_target is not None:
            return self.loss_curve.iterations_to_loss(self.spec.convergence_target)
        return None

    def iteration_at(self, t: float) -> float:
        """Iterations done at virtual time ``t`` (within the current segment)."""
        if not self.world or self.completed:
            return self.iteration
        done = self.iteration + self.rate() * max(0.0, t - self.stopped_until)
        total = self.total
        return done if total is None else min(total, done)

    def finish_at(self) -> float | None:
        """The virtual instant the job completes at the current rate, rounded up to a
        whole second exactly as the simulator does (``SimConfig`` completions)."""
        total, rate = self.total, self.rate()
        if total is None or rate <= 0 or not self.world or self.completed:
            return None
        exact = self.stopped_until + max(0.0, total - self.iteration) / rate
        return float(math.ceil(exact - _EPS))

    async def _publish(self, event: ev.Event, *, at: float | None = None, **kw: object) -> None:
        stamp = self.clock.now() if at is None else at
        await self.bus.publish(codec.wrap(event, at=stamp), **kw)  # type: ignore[arg-type]

    async def apply(self, cmd: ev.Reconfigure) -> None:
        """Handle one order (see the module docstring), inside its span."""
        parent = extract(self.order_context.pop(cmd.epoch, None))
        attributes: dict[str, AnyValue] = {
            "shoal.job_id": self.job_id,
            "shoal.epoch": cmd.epoch,
            "shoal.node_id": self.node_id,
            "shoal.gpus": len(cmd.gpus),
        }
        span = self.tracer.start_span(
            "sidecar.reconfigure", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
        )
        try:
            with trace.use_span(span), bound_job(job_id=self.job_id, epoch=cmd.epoch):
                await self._apply(cmd, span)
        finally:
            # A reconfiguration now in flight ends its span when it completes.
            in_flight = self._flight_spans is not None and self._flight_spans[0] is span
            if span.is_recording() and not in_flight:
                span.end()

    def _end_flight_spans(self, outcome: str) -> None:
        if self._flight_spans is None:
            return
        reconfigure, resume = self._flight_spans
        self._flight_spans = None
        resume.end()
        reconfigure.set_attribute("shoal.outcome", outcome)
        reconfigure.end()

    async def _apply(self, cmd: ev.Reconfigure, span: trace.Span) -> None:
        now = self.clock.now()
        if cmd.epoch <= self.epoch:
            log.info("stale_order_ignored", job_id=self.job_id, epoch=cmd.epoch, newest=self.epoch)
            span.set_attribute("shoal.outcome", "stale")
            return
        # The order takes effect when the allocator decided it, not when it reached
        # this process (see the module docstring); never before the current segment.
        t = now if cmd.effective_at is None else min(now, max(cmd.effective_at, self.segment_at))
        was_leader = self.is_leader
        finish = self.finish_at() if was_leader and self.in_flight is None else None
        if finish is not None and finish <= t:
            # The job ended before this order took effect; this process was only late
            # to notice (a busy machine at a high time scale). Complete it at its own
            # instant, as the simulator does; the order then finds nothing to change.
            await self._complete(finish)
            span.set_attribute("shoal.outcome", "completed_before")
            return
        done = self.iteration_at(t)
        old_world, old_gpus = self.world, self.gpus
        same_instant = self._prior is not None and abs(self._prior[0] - t) < _EPS
        if same_instant:
            # The shape of the previous order was in force for no virtual time (an
            # allocator that decided on part of a same-instant burst, then on all of
            # it): this change is counted from the shape before that one, as the
            # simulator, which decides once per instant, counts it.
            _, old_world, old_gpus = self._prior  # type: ignore[misc]
        with self.tracer.start_as_current_span("sidecar.stop", attributes={"shoal.from_world": old_world}):
            if self.in_flight is not None and was_leader:
                await self._publish(
                    ev.ReconfigurationCancelled(
                        job_id=self.job_id, epoch=self.in_flight[0], by_epoch=cmd.epoch, reason="superseded"
                    ),
                    at=t,
                )
                self.in_flight = None
            self._end_flight_spans("superseded")
            self.iteration = done
            self.segment_at = t
            self.stopped_until = t
            if was_leader and old_world:
                # Hand the exact progress at this instant to whoever leads next (0 GPUs
                # from now on when the job is preempted).
                await self._report(t, num_gpus=old_world if cmd.gpus else 0)
        with self.tracer.start_as_current_span("sidecar.switch") as switch:
            self.epoch = cmd.epoch
            self.gpus = tuple(sorted(cmd.gpus))
            if self.is_leader and not was_leader:
                # Leadership moved to this node: carry the job's progress over, and count
                # the change from the shape the job had (a move, not a fresh start).
                previous = await self._resume_progress(at=t)
                if previous and not old_world:
                    old_world, old_gpus = previous, ()
            if not same_instant:
                self._prior = (t, old_world, old_gpus)
            kind = classify(old_world, self.world, set(old_gpus) != set(self.gpus))
            switch.set_attributes({"shoal.to_world": self.world, "shoal.leader": self.is_leader})
        if not self.is_leader or kind is None:
            span.set_attribute("shoal.outcome", "follower" if not self.is_leader else "unchanged")
            return
        stop = self.costs.stop_time(kind)
        span.set_attributes(
            {
                "shoal.kind": kind,
                "shoal.from_world": old_world,
                "shoal.to_world": self.world,
                "shoal.stop_time_s": stop,
            }
        )
        await self._publish(
            ev.ReconfigurationStarted(
                job_id=self.job_id, epoch=cmd.epoch, kind=kind, from_world=old_world, to_world=self.world
            ),
            at=t,
        )
        log.info(
            "reconfiguration_started", kind=kind, from_world=old_world, to_world=self.world, stop_time_s=stop
        )
        self.stopped_until = t + stop
        self.in_flight = (cmd.epoch, t, stop)
        resume = self.tracer.start_span("sidecar.resume", attributes={"shoal.stop_time_s": stop})
        self._flight_spans = (span, resume)
        if now >= self.stopped_until:
            await self._finish_reconfiguration()

    async def _finish_reconfiguration(self) -> None:
        if self.in_flight is None:
            return
        epoch, started, stop = self.in_flight
        self.in_flight = None
        # The profiler's window end of this shape, from the ReconfigurationCompleted
        # stamp published below.
        window = self.measure_window_s
        self.reports.changed(None if not window else measurement_window_end(started + stop, window))
        spans = self._flight_spans
        resume = spans[1] if spans is not None else trace.INVALID_SPAN
        try:
            with trace.use_span(resume), bound_job(job_id=self.job_id, epoch=epoch):
                await self._publish(
                    ev.ReconfigurationCompleted(
                        job_id=self.job_id,
                        epoch=epoch,
                        world_size=self.world,
                        gpus=self.gpus,
                        stop_time_s=stop,
                        duration_s=stop,
                    ),
                    at=started + stop,
                )
                log.info("reconfiguration_completed", world_size=self.world, stop_time_s=stop)
        finally:
            if self._flight_spans is spans:
                self._end_flight_spans("completed")

    async def _report(self, at: float, num_gpus: int | None = None) -> None:
        if self.spec is None:
            return
        self._last_report_wall = asyncio.get_running_loop().time()
        world = self.world if num_gpus is None else num_gpus
        # The rate of the shape reported (a hand-over report names the shape the job ran
        # on until now, which after a same-instant order is not the newest one).
        rate = self.curve[min(world, len(self.curve) - 1)] if world else 0.0
        await self._publish(
            ev.ProgressReported(
                job_id=self.job_id,
                iteration=int(self.iteration_at(at) + _EPS),
                samples_per_s=rate * max(1, self.spec.global_batch_size),
                num_gpus=world,
                epoch=self.epoch,
                loss=None
                if self.loss_curve is None
                else self.loss_curve.loss(int(self.iteration_at(at) + _EPS)),
            ),
            at=at,
        )

    def _seconds_to_next_wake(self, now: float) -> float:
        """Wall seconds until something is due: the end of a stop, completion or a report."""
        waits = [self.reports.interval_s]
        scale = getattr(self.clock, "scale", 1.0)
        if self.reports.window_at is not None and self.is_leader and now < self.reports.window_at:
            waits.append((self.reports.window_at - now) / scale)
        if self.in_flight is not None:
            waits.append((self.stopped_until - now) / scale)
        finish = self.finish_at() if self.is_leader else None
        if finish is not None:
            waits.append((finish - now) / scale)
        return max(0.0, min(waits))

    def _hold_finish(self) -> None:
        """With a synchronized clock, hold it at the job's finish instant while this
        process leads the job, so that virtual time cannot pass the completion before
        it is published (see :class:`~shoal.clock.SharedClock`)."""
        finish = self.finish_at() if self.is_leader and not self.completed else None
        if finish == self._finish_held:
            return
        key = f"finish:{self.job_id}:{self.node_id}"
        if finish is None:
            release(self.clock, key)
        else:
            hold(self.clock, key, finish, ttl_s=None)
        self._finish_held = finish

    async def _take(self, cmd: ev.Reconfigure) -> None:
        """Apply one order, then hold the clock at the new finish instant and let go
        of the hold the node daemon sent the order under."""
        try:
            await self.apply(cmd)
            self._hold_finish()
        finally:
            release(self.clock, f"order:{cmd.epoch}:{self.node_id}:{self.job_id}")

    async def _complete(self, finish: float) -> None:
        """Complete the job at its finish instant (the leader does, once)."""
        total = self.total
        assert total is not None
        self.iteration = total
        self.segment_at = self.stopped_until = finish
        await self._report(finish)
        # The allocator releases it once it has decided on the completion.
        hold(self.clock, done_key(self.job_id))
        try:
            await self.bus.publish_first(
                codec.wrap(ev.JobCompleted(job_id=self.job_id, iterations=int(total)), at=finish)
            )
        except ConcurrencyConflict:
            pass  # another sidecar of this job completed it first
        self.completed = True
        self._hold_finish()
        log.info("job_completed", job_id=self.job_id, iterations=total, at=finish)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            self._end_flight_spans("unfinished")

    async def _run(self, stop: asyncio.Event) -> None:
        await self.load()
        loop = asyncio.get_running_loop()
        while not stop.is_set() and not self.completed:
            now = self.clock.now()
            # When something is already overdue (this process started late, or is
            # behind), first take the orders already sent: one of them may change the
            # job before that instant. Otherwise wake exactly when it is due: a floor
            # here would make every completion late by up to that floor (10 ms is 10
            # virtual seconds at 1000×), and a late completion can reach the allocator
            # after a later event.
            due = self._seconds_to_next_wake(now)
            wait = min(due if due > 0 else _DRAIN_S, 0.5)
            with contextlib.suppress(TimeoutError):
                cmd = await asyncio.wait_for(self.commands.get(), wait)
                await self._take(cmd)
                continue
            now = self.clock.now()
            if not self.is_leader:
                continue
            if self.in_flight is not None and now >= self.stopped_until:
                await self._finish_reconfiguration()
            finish = self.finish_at()
            if finish is not None and now >= finish:
                await self._complete(finish)
            elif (
                self.world
                and now > self.segment_at + _EPS
                and self.reports.due(loop.time() - self._last_report_wall, now)
            ):
                # Not at the instant the current shape began: such a report would tell a
                # leader taking over at that instant that the job ran on this shape
                # before it (a move), where it started or changed only then.
                await self._report(now)
                self.reports.reported(now)
        # Orders sent just before the end of stdin (the node daemon's last word on a
        # job leaving this node) still hand the progress over.
        while not self.completed and not self.commands.empty():
            await self._take(self.commands.get_nowait())


def parse_order(line: bytes) -> ev.Reconfigure:
    """One order from the node daemon: a JSON ``Reconfigure`` per line.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: a malformed order (a string that
            is not UTF-8 included: msgspec before 0.23 raises ``UnicodeDecodeError``
            there, which the sidecar's loop would not catch).
    """
    try:
        return msgspec.json.decode(line, type=ev.Reconfigure)
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"an order string is not UTF-8: {exc}") from None


def parse_traced_order(line: bytes) -> tuple[ev.Reconfigure, dict[str, str]]:
    """:func:`parse_order`, plus the W3C trace fields the node daemon sent with it
    (``traceparent``/``tracestate``; empty for an order without them).

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: a malformed order.
    """
    return parse_order(line), trace_fields(line)

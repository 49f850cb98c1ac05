"""placer: turns share decisions into concrete GPUs.

Consumes: the event log through a :class:`~shoal.projection.Projection`; acts on
``SharesDecided`` and on node changes.

Decides: :func:`shoal.allocation.place` (network-packed, min-migration placement,
CoDDL §4.4) on :func:`shoal.cluster.topology_from_state` — the same functions the
simulator calls.

Publishes: ``PlacementDecided`` for the newest epoch only (an older epoch that is
still waiting when a newer one arrives is skipped), appended with
``Nats-Expected-Last-Subject-Sequence``; then one ``ReconfigurationRequested`` per job
whose GPU set changed — the per-node commands. Node daemons act on the placement of
the newest epoch for their node (level-triggered, so a missed message is repaired
by the next one).

Synchronized clock (emulation, :class:`shoal.clock.SharedClock`): the placer
releases the decision's hold once it is placed (or superseded), after holding the
clock for each node whose jobs change (``place:<epoch>:<node>``, released by that
node's daemon once its orders are sent).

Tracing: a placement continues the trace of the decision it places. The placer reads
the log through a projection, so it takes the context from the stored headers of
that ``SharesDecided`` (one request, only when tracing is on): span ``placer.place``
with the phases ``placer.compute`` and ``placer.publish``; the published events carry
it on to the node daemons.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from shoal import codec
from shoal import events as ev
from shoal.allocation import place
from shoal.bus import Bus, Campaign, ConcurrencyConflict, SkippedMessage
from shoal.clock import Clock, hold, release
from shoal.cluster import topology_from_state
from shoal.events import Envelope
from shoal.log import bound_job
from shoal.projection import CLUSTER_SNAPSHOT, Projection
from shoal.state import FINISHED_STATUSES, ClusterState
from shoal.telemetry import producer_span, stored_context, tracing_enabled

log = structlog.get_logger("shoal.placer")


class PlacerService:
    def __init__(
        self,
        bus: Bus,
        *,
        holder: str,
        clock: Clock,
        placer: str = "min-migration",
        lease_ttl_s: float = 3.0,
        tracer: trace.Tracer | None = None,
        projection: Projection | None = None,
    ) -> None:
        self.bus = bus
        self.tracer = tracer or trace.get_tracer("shoal.placer")
        self.holder = holder
        self.clock = clock
        self.placer = placer
        self.lease_ttl_s = lease_ttl_s
        if projection is None:
            projection = Projection(bus, snapshot_name=CLUSTER_SNAPSHOT)
        projection.add_listener(self._on_event)
        projection.add_skip_listener(self._on_skipped)
        self._placements_subject = f"{bus.names.prefix}.alloc.placement_decided"
        self._shares_subject = f"{bus.names.prefix}.alloc.shares_decided"
        self.projection = projection
        """The log as this service sees it; may be shared with services of the same
        process (see :mod:`shoal.projection`)."""
        self.latest: ev.SharesDecided | None = None
        self.latest_at = 0.0
        self.latest_seq = 0
        """Stream sequence of ``latest`` (its stored headers carry the decision's trace)."""
        self.placements_seq = 0
        """Stream sequence of the newest message on the placement subject, whatever it
        holds (for the expected-sequence append)."""
        self._instant = -float("inf")
        """Instant (``decided_at``) of the newest placement."""
        self._placed_now: dict[str, tuple[ev.GpuRef, ...]] = {}
        self._placed_before: dict[str, tuple[ev.GpuRef, ...]] = {}
        """The placement in force before ``_instant`` (see :meth:`_anchor`)."""
        self.dirty = asyncio.Event()
        self.is_leader = False
        self.role: str | None = None
        """``"leader"`` or ``"standby"`` once the lease was asked for (the probes' readiness)."""
        self._held_epochs: set[int] = set()
        """Epochs of decisions whose clock hold this placer releases once it has placed
        them or a newer one (a :class:`~shoal.clock.SharedClock` only)."""

    def _on_event(self, seq: int, env: Envelope, state: ClusterState) -> None:
        e = env.event
        if isinstance(e, ev.SharesDecided):
            self._held_epochs.add(e.epoch)
            if self.latest is None or e.epoch > self.latest.epoch:
                self.latest = e
                self.latest_at = env.at
                self.latest_seq = seq
                self.dirty.set()
        elif isinstance(e, ev.PlacementDecided):
            self.placements_seq = seq
            if e.decided_at > self._instant + 1e-9:
                self._placed_before, self._instant = self._placed_now, e.decided_at
            self._placed_now = e.placements  # events are never mutated
        elif isinstance(e, ev.NodeLost | ev.NodeDrained | ev.NodeRegistered):
            self.dirty.set()

    def _on_skipped(self, skipped: SkippedMessage) -> None:
        # A message there that does not decode still moves the subject's last sequence.
        if skipped.subject == self._placements_subject:
            self.placements_seq = max(self.placements_seq, skipped.seq)

    async def place_once(self) -> ev.PlacementDecided | None:
        newest = self.latest.epoch if self.latest is not None else 0
        try:
            return await self._place_latest()
        finally:
            # This decision and any it superseded are placed (or need no placement):
            # their holds on a synchronized clock go; the node daemons hold it now.
            done = [e for e in self._held_epochs if e <= newest]
            if done:
                self._held_epochs.difference_update(done)
                release(self.clock, *(f"epoch:{e}" for e in done))

    async def _place_latest(self) -> ev.PlacementDecided | None:
        shares, shares_at, shares_seq = self.latest, self.latest_at, self.latest_seq
        state = self.projection.state
        if shares is None or shares.epoch < state.placement_epoch:
            return None
        if shares.epoch == state.placement_epoch and not self._placement_broken(state):
            return None
        parent = Context()
        if tracing_enabled(self.tracer):
            parent = await stored_context(self.bus.js, self.bus.names.events_stream, shares_seq)
            state = self.projection.state  # the same object; read again after the await
        attributes = {
            "shoal.epoch": shares.epoch,
            "shoal.trigger": shares.trigger,
            "shoal.placer": self.placer,
        }
        with (
            self.tracer.start_as_current_span(
                "placer.place", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
            ) as span,
            bound_job(epoch=shares.epoch),
        ):
            return await self._place(shares, shares_at, state, span)

    async def _place(
        self, shares: ev.SharesDecided, shares_at: float, state: ClusterState, span: trace.Span
    ) -> ev.PlacementDecided | None:
        t0 = time.time_ns()
        previous = {j: state.jobs[j].placement for j in state.placed}
        decided, result = place(
            topology_from_state(state), shares, self._anchor(shares_at, previous, state), placer=self.placer
        )
        decided = msgspec.structs.replace(decided, decided_at=shares_at)
        self.tracer.start_span("placer.compute", start_time=t0).end()
        span.set_attributes(
            {
                "shoal.jobs": len(decided.placements),
                "shoal.migrations": decided.migrations,
                "shoal.unplaced": len(result.unplaced),
            }
        )
        now = self.clock.now()
        env = codec.wrap(decided, at=now)
        new = decided.placements
        moved = [
            j for j in previous.keys() | new.keys() if tuple(previous.get(j, ())) != tuple(new.get(j, ()))
        ]
        nodes = sorted({g.node_id for j in moved for g in (*previous.get(j, ()), *new.get(j, ()))})
        # The node daemons release these once they have sent their orders (a
        # synchronized clock stands still until then).
        for node_id in nodes:
            hold(self.clock, f"place:{decided.epoch}:{node_id}")
        try:
            with producer_span("placer.publish", tracer=self.tracer):
                res = await self.bus.publish(env, expected_last_subject_seq=self.placements_seq)
        except ConcurrencyConflict:
            release(self.clock, *(f"place:{decided.epoch}:{n}" for n in nodes))
            span.set_attribute("shoal.conflict", True)
            await self.projection.wait_for(await self.bus.last_seq())
            return None
        requests = [
            codec.wrap(
                ev.ReconfigurationRequested(job_id=j, epoch=decided.epoch, gpus=gpus),
                at=now,
                causation_id=env.id,
            )
            for j, gpus in sorted(decided.placements.items())
            if tuple(previous.get(j, ())) != gpus
        ] + [
            codec.wrap(
                ev.ReconfigurationRequested(job_id=j, epoch=decided.epoch, gpus=()),
                at=now,
                causation_id=env.id,
            )
            for j in sorted(previous.keys() - decided.placements.keys())
            if j in state.jobs
        ]
        if requests:
            with producer_span(
                "placer.publish_requests", tracer=self.tracer, attributes={"shoal.requests": len(requests)}
            ):
                await self.bus.publish_many(requests)
        await self.projection.wait_for(res.seq)
        if result.unplaced:
            log.warning("unplaced", epoch=decided.epoch, unplaced=result.unplaced)
        log.info(
            "placement_decided",
            epoch=decided.epoch,
            jobs=len(decided.placements),
            migrations=decided.migrations,
            stream_seq=res.seq,
        )
        return decided

    def _anchor(
        self, at: float, current: dict[str, tuple[ev.GpuRef, ...]], state: ClusterState
    ) -> dict[str, tuple[ev.GpuRef, ...]]:
        """The placement min-migration keeps jobs on: the current one, except that a
        placement made at this same instant ``at`` was in force for no time, and the
        one before it counts instead (for jobs still active). An allocator that decided on
        part of a same-instant burst first would otherwise pin the jobs of that partial
        decision to GPUs the simulator, deciding once per instant, never gave them."""
        if abs(at - self._instant) > 1e-9:
            return current
        return {
            j: g
            for j, g in self._placed_before.items()
            if j in state.jobs and state.jobs[j].status not in FINISHED_STATUSES
        }

    @staticmethod
    def _placement_broken(state: ClusterState) -> bool:
        """A placed GPU is on a node that is no longer up: re-place the same epoch."""
        up = {n for n, node in state.nodes.items() if node.status == "up"}
        return any(g.node_id not in up for j in state.placed for g in state.jobs[j].placement)

    async def _restore_cursors(self) -> None:
        """After a snapshot the listener saw only the tail: read the newest decision and
        placement from their subjects (the expected-sequence cursor, the decision to
        place, the instant and GPUs of the placement in force)."""
        last, valid = await self.bus.last_valid_on_subject(self._placements_subject)
        self.placements_seq = max(self.placements_seq, last)
        state = self.projection.state
        if valid is not None and isinstance(valid[1].event, ev.PlacementDecided):
            at = valid[1].event.decided_at
            if at > self._instant + 1e-9:
                current = {j: state.jobs[j].placement for j in state.placed}
                self._instant, self._placed_now, self._placed_before = at, current, current
        _, decision = await self.bus.last_valid_on_subject(self._shares_subject)
        if decision is not None and isinstance(decision[1].event, ev.SharesDecided):
            e = decision[1].event
            if self.latest is None or e.epoch > self.latest.epoch:
                self.latest, self.latest_at, self.latest_seq = e, decision[1].at, decision[0]
                self.dirty.set()

    async def run(self, stop: asyncio.Event) -> None:
        await self.projection.start()
        await self.projection.wait_ready()
        if self.projection.restored_from_snapshot:
            await self._restore_cursors()
        campaign = Campaign(await self.bus.lease("placer", self.holder, ttl_s=self.lease_ttl_s))
        try:
            while not stop.is_set():
                renewed = campaign.due()
                await campaign.poll()
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if renewed and self.is_leader:
                    self.dirty.set()  # re-check on every renewal (a lost node, a takeover)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.dirty.wait(), campaign.until_due())
                # After the wait (a pause may have outlived the lease): lead only if still valid.
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if self.is_leader and self.dirty.is_set():
                    self.dirty.clear()
                    await self.place_once()
        finally:
            await campaign.release()
            await self.projection.stop()

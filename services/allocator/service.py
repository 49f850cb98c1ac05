"""allocator: decides every job's share of GPUs.

Consumes: the whole event log through a :class:`~shoal.projection.Projection`
(snapshot + replay + live tail).

Decides: :func:`shoal.profiling.overestimate.decide_overestimate_first` (that is
:func:`shoal.allocation.decide_shares` with AFS §4.5's 1/n cap on new jobs and its
measurement of the smaller allocatable units, fed by :func:`shoal.view.estimated_jobs`)
over :func:`shoal.view.build_view` — the same functions the simulator calls — on
churn: arrival, completion, model update, node change, trade and the policy's
quantum tick. Bursts are coalesced:
triggers only mark the state dirty, and the triggers pending within one second of
virtual time make one decision. There is no waiting window by default
(``coalesce_s=0``): a decision starts as soon as a trigger is seen, and whatever
arrives while it is being made is batched into the next one, so the allocator
batches exactly as much as it falls behind (a fixed window cost every decision
its length in latency: 7 ms of the 22 ms p50 measured by
``benchmarks/bench_services.py`` with a 5 ms window).

Decision time. A decision is made *as of* the newest triggering event of its burst
(its ``at``), not as of the wall clock when the allocator got round to it: the
``SharesDecided`` is stamped with that instant, so attained service and the policy's
inputs do not depend on control-plane latency, and a replayed allocator (or the
simulator, fed the same events) decides at the same instants. Periodic policies
(``tick_s``/``lease_s``/``quantum_s``) and ``policy_memory["next_decision_at_s"]``
wake the allocator on the grid ``tick_origin + k·tick`` of virtual time, as the
simulator does. In emulation at 1000× this is what keeps a 20 ms coalescing window
from becoming 20 virtual seconds of delay.

Publishes: ``SharesDecided`` with a strictly increasing epoch, appended with
``Nats-Expected-Last-Subject-Sequence`` on ``<prefix>.alloc.shares_decided``: a
deposed leader that still believes it leads cannot append a decision made on a
stale view (it gets a conflict and re-reads the log). Also ``NodeLost`` for nodes
whose heartbeats stopped.

Node liveness is judged from the heartbeats' own stamps, not from when this allocator
got round to reading them (:func:`shoal.cluster.lost_nodes`). Heartbeats are not in the
log: each node daemon stores them in the beats stream, which keeps at most eight per node,
each for twice the node's interval, and refuses a node's next one while it holds eight
(the per-node rate limit, :meth:`shoal.bus.Bus.publish_beat`); the leader reads every
node's newest one (:meth:`shoal.bus.Bus.latest_beats`, one direct get per node) at most
every ``min(1, node_timeout_s/4)`` wall seconds and remembers the newest stamp of each
(:func:`shoal.cluster.remember_beats`: a node with none stored at a new leader's first
look gets a full timeout from that look). A node is lost when its newest heartbeat (or
registration) is more than ``node_timeout_s`` older than the newest heartbeat of any
node, read at once: an allocator that was stopped or lags reads every node's current
heartbeat and declares nobody lost for that, and a flood of heartbeats stores at most
eight a second (the rate a reader sees is its own). The decision, ``NodeLost``, is
an event in the log, so a replay rebuilds the same state. A node declared lost comes
back when its daemon re-registers (see ``shoal_services.node_daemon.service``).
``NodeHeartbeat`` events in the log (an installation from before the beats stream; only
the admin may append one now) are folded by the projection but trigger nothing.

Synchronized clock (emulation, :class:`shoal.clock.SharedClock`): the allocator
releases the hold an arrival, completion or throughput model was published under once
it has decided on it, publishes each decision under a hold of its own (``epoch:<n>``,
released by the placer), and holds the clock at its next periodic decision, so virtual
time cannot pass a lease end before the decision there is made. A decision that gives
a job on AFS §4.5's estimate a GPU count not measured yet also holds ``measure:<job>``
for the profiler, which keeps the clock from passing the end of that measurement
(see the profiler's docstring).

Exactly one allocator decides at a time: the leader lease lives in JetStream KV;
standbys follow the log and take over when the lease lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import Counter, Histogram
from shoal import codec
from shoal import events as ev
from shoal.allocation import next_tick, policy_tick
from shoal.bus import Bus, Campaign, ConcurrencyConflict, SkippedMessage
from shoal.clock import HOLD_TTL_S, Clock, hold, hold_key, measure_key, release
from shoal.cluster import gpus_per_node, lost_nodes, remember_beats
from shoal.events import Envelope
from shoal.log import bound_job
from shoal.models import Catalog
from shoal.policies.base import Policy
from shoal.profiling.overestimate import decide_overestimate_first
from shoal.progress import carry_progress_forward
from shoal.projection import CLUSTER_SNAPSHOT, Projection, snapshot_due
from shoal.state import NODE_UP, ClusterState, apply, copy_state
from shoal.telemetry import producer_span, stored_context, tracing_enabled

log = structlog.get_logger("shoal.allocator")

DECISIONS = Counter(
    "shoal_allocator_decisions", "SharesDecided this process published, by trigger.", ["trigger"]
)
DECISION_SECONDS = Histogram(
    "shoal_allocator_decision_seconds",
    "Wall seconds from the start of a decision (view, policy) to its append being folded back.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

_Shares = tuple[dict[str, int], dict[str, str], dict[str, Any]]

_TRIGGERS: dict[type, str] = {
    ev.JobSubmitted: "arrival",
    ev.JobCompleted: "completion",
    ev.JobFailed: "completion",
    ev.JobCancelled: "completion",
    ev.JobRejected: "completion",
    ev.ThroughputModelUpdated: "model_update",
    ev.ConvergenceEstimated: "model_update",
    ev.NodeRegistered: "node_change",
    ev.NodeLost: "node_change",
    ev.NodeDrained: "node_change",
    ev.TradeExecuted: "trade",
    ev.TradeUndone: "trade",
    ev.TicketsSet: "tickets",
}


class AllocatorService:
    """Leader-elected allocator. See the module docstring."""

    def __init__(
        self,
        bus: Bus,
        policy: Policy,
        *,
        holder: str,
        clock: Clock,
        lease_ttl_s: float = 3.0,
        coalesce_s: float = 0.0,
        tick_s: float | None = None,
        catalog: Catalog | None = None,
        network_packing: bool = True,
        node_timeout_s: float | None = 10.0,
        heartbeat_s: float = 1.0,
        snapshot_every: int = 10_000,
        snapshot_interval_s: float = 60.0,
        tick_origin: float = 0.0,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.bus = bus
        self.tracer = tracer or trace.get_tracer("shoal.allocator")
        """Each published decision is the root span of one trace (see :meth:`_traced_decision`)."""
        self.policy = policy
        self.holder = holder
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.coalesce_s = coalesce_s
        self.tick_s = tick_s if tick_s is not None else policy_tick(policy)
        self.tick_origin = tick_origin
        self.catalog = catalog
        self.network_packing = network_packing
        self.node_timeout_s = node_timeout_s
        self.heartbeat_s = heartbeat_s
        self._liveness_due = -math.inf
        """Event-loop time of the next liveness check."""
        self._beats: dict[str, float] = {}
        """node id -> stamp of the newest heartbeat read from the beats stream."""
        self._declared: dict[str, float] = {}
        """node id -> heartbeat stamp it was declared lost at (not declared twice)."""
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        """The leader writes the cluster snapshot (:data:`~shoal.projection.CLUSTER_SNAPSHOT`,
        which every service starts from) once ``snapshot_every`` messages were folded since
        the last one, or ``snapshot_interval_s`` wall seconds after it if any was."""
        self.projection = Projection(
            bus,
            snapshot_name=CLUSTER_SNAPSHOT,
            listeners=[self._on_event],
            skip_listeners=[self._on_skipped],
        )
        self._decisions_subject = f"{bus.names.prefix}.alloc.shares_decided"
        self.dirty = asyncio.Event()
        self.trigger = ""
        self.pending: list[tuple[float, str, str | None, str | None]] = []
        self._trigger_seq: dict[str, int] = {}
        """Stream sequence of each pending trigger event (its stored trace context is
        the parent of the decision it causes)."""
        """Triggering events not yet decided on: (occurred-at, trigger, event id, key of
        the clock hold it was published under — a :class:`~shoal.clock.SharedClock`
        only — released once a decision has taken it in)."""
        self._wake_held: float | None = None
        self._resumed_at: dict[str, float] = {}
        """job id -> instant its newest reconfiguration completed (training resumed)."""
        self.asof: ClusterState | None = None
        """The leader's decision state: the log folded up to the last decision instant."""
        self.buffer: list[Envelope] = []
        """Events of the log not yet folded into ``asof`` (stamped after its instant)."""
        self.last_decision_at = 0.0
        self.decisions_seq = 0
        """Stream sequence of the newest message on the decision subject, whatever it holds
        (for the expected-sequence append; a message there that does not decode counts)."""
        self.decided = 0
        self.is_leader = False
        self.role: str | None = None
        """``"leader"`` or ``"standby"`` once the lease was asked for (the probes' readiness)."""
        self._snapshot_seq = 0
        """Sequence of the newest snapshot this allocator wrote or started from."""
        self._snapshot_at = time.monotonic()
        self.snapshots = 0
        """Snapshots written by this allocator."""
        self._campaign: Campaign | None = None
        """The leader lease campaign (set by :meth:`run`)."""
        self._instant = -math.inf
        """Instant of the newest decision."""
        self._in_force: _Shares = ({}, {}, {})
        """(shares, GPU types, policy memory) of the newest decision."""
        self._before: _Shares = ({}, {}, {})
        """The same, of the decision in force before ``_instant`` (see :meth:`decide_once`)."""

    # -- consuming --------------------------------------------------------------

    def _on_event(self, seq: int, env: Envelope, state: ClusterState) -> None:
        if isinstance(env.event, ev.NodeHeartbeat):
            return  # no decision reads heartbeats (and new ones are not in the log)
        if self.asof is not None:
            self.buffer.append(env)
        if isinstance(env.event, ev.SharesDecided):
            self.decisions_seq = seq
            self.last_decision_at = max(self.last_decision_at, env.at)
            if env.at > self._instant + 1e-9:
                self._before, self._instant = self._in_force, env.at
            e = env.event
            self._in_force = (e.shares, e.gpu_types, e.policy_memory)  # events are never mutated
            return
        if isinstance(env.event, ev.ReconfigurationCompleted):
            # Progress resumes at this instant (see :func:`shoal.progress.carry_progress_forward`).
            self._resumed_at[env.event.job_id] = env.at
        trigger = _TRIGGERS.get(type(env.event))
        if trigger is not None:
            self.pending.append((env.at, trigger, env.id, hold_key(env.event)))
            self._trigger_seq[env.id] = seq
            self.dirty.set()

    def _on_skipped(self, skipped: SkippedMessage) -> None:
        # A message on the decision subject that does not decode still moves the
        # subject's last sequence: without this every append would conflict.
        if skipped.subject == self._decisions_subject:
            self.decisions_seq = max(self.decisions_seq, skipped.seq)

    def _state_as_of(self, at: float) -> ClusterState:
        """Fold the buffered events stamped at or before ``at`` into the decision state.

        A decision as of ``at`` sees exactly the events that occurred by then, whatever
        order or delay they reached the allocator in: the same instants and inputs as
        the simulator, and as a replay of the log.
        """
        if self.asof is None:
            return self.projection.state
        keep: list[Envelope] = []
        for env in self.buffer:
            if env.at <= at + 1e-9:
                apply(self.asof, env)
            else:
                keep.append(env)
        self.buffer = keep
        return self.asof

    # -- deciding ---------------------------------------------------------------

    def _wakeup_at(self) -> float | None:
        """Virtual instant of the next periodic decision, or ``None``."""
        state = self.asof if self.asof is not None else self.projection.state
        if not state.active_jobs():
            return None
        due: list[float] = []
        if self.tick_s:
            due.append(next_tick(self.last_decision_at, self.tick_s, self.tick_origin))
        # The newest decision's memory (``asof`` folds it only at the next decision),
        # on whole seconds as in the simulator.
        wake = self._in_force[2].get("next_decision_at_s")
        if isinstance(wake, int | float) and (wake := float(math.ceil(wake - 1e-6))) > self.last_decision_at:
            due.append(wake)
        return min(due) if due else None

    async def decide_once(
        self,
        trigger: str,
        *,
        at: float | None = None,
        causation_id: str | None = None,
        trigger_seq: int = 0,
    ) -> ev.SharesDecided | None:
        """Run the policy on the current state as of ``at`` (default: now) and publish
        the decision if it changed."""
        t0 = time.time_ns()
        now = max(self.clock.now() if at is None else at, self.last_decision_at)
        state = self._state_as_of(now)
        from shoal.view import build_view, estimated_jobs, with_current_shares

        view = build_view(state, now=now, gpus_per_node=gpus_per_node(state), catalog=self.catalog)
        view = carry_progress_forward(view, state, now, self._resumed_at)
        memory = state.policy_memory
        if abs(now - self._instant) <= 1e-9:
            # Deciding again at the instant of the newest decision (the rest of a burst
            # reached this allocator after it decided on the first part): that decision
            # was in force for no time, so this one starts from the shares and policy
            # memory before it, as the simulator's one decision per instant does.
            shares_before, types_before, memory = self._before
            view = with_current_shares(view, shares_before, types_before)
        t1 = time.time_ns()
        # AFS §4.5: new jobs capped at 1/n, measured jobs moved through their smaller
        # allocatable units (the same function and estimates as the simulator's).
        estimates = estimated_jobs(state, [j.job_id for j in view.jobs], self.catalog)
        decision = decide_overestimate_first(
            self.policy,
            view,
            memory,
            estimates=estimates,
            epoch=state.shares_epoch + 1,
            trigger=trigger,
            network_packing=self.network_packing,
        )
        marks = (t0, t1, time.time_ns())
        current_types = {j: state.jobs[j].gpu_type for j in state.shares if state.jobs[j].gpu_type}
        if (
            decision.shares == state.shares
            and decision.gpu_types == current_types
            and decision.policy_memory == state.policy_memory
            and state.shares_epoch
        ):
            return None
        if not decision.shares and not state.shares:
            # Nothing held and nothing to give (a leader with no jobs yet): as in the
            # simulator, whose first decision is the first that gives a job GPUs.
            return None
        env = codec.wrap(decision, at=now, causation_id=causation_id)
        parent = Context()
        if trigger_seq and tracing_enabled(self.tracer):
            # The decision continues the trace of the event that caused it (a submission
            # that began at the client), so one trace runs from submit to reconfiguration.
            parent = await stored_context(self.bus.js, self.bus.names.events_stream, trigger_seq)
        # The placer releases this once it has placed the decision (synchronized clock).
        hold(self.clock, f"epoch:{decision.epoch}")
        # A job given a GPU count it has not been measured at: the clock may not pass the
        # end of that measurement before it is published (the profiler moves this hold
        # to the end of the window and releases it; AFS §4.5).
        measuring = [
            measure_key(job_id)
            for job_id, gpus in decision.shares.items()
            if (counts := estimates.get(job_id)) is not None
            and gpus not in counts
            and gpus != state.shares.get(job_id, 0)
        ]
        for key in measuring:
            hold(self.clock, key, ttl_s=3 * HOLD_TTL_S)
        with self._traced_decision(decision, marks, parent):
            try:
                with producer_span("allocator.publish", tracer=self.tracer):
                    result = await self.bus.publish(env, expected_last_subject_seq=self.decisions_seq)
            except ConcurrencyConflict:
                release(self.clock, f"epoch:{decision.epoch}", *measuring)
                log.warning(
                    "decision_conflict", epoch=decision.epoch, note="another allocator decided; re-reading"
                )
                trace.get_current_span().set_attribute("shoal.conflict", True)
                await self.projection.wait_for(await self.bus.last_seq())
                return None
            await self.projection.wait_for(result.seq)
            self.decided += 1
            DECISIONS.labels(trigger=trigger).inc()
            DECISION_SECONDS.observe((time.time_ns() - t0) / 1e9)
            log.info(
                "shares_decided",
                epoch=decision.epoch,
                trigger=trigger,
                jobs=len(decision.shares),
                gpus=sum(decision.shares.values()),
                stream_seq=result.seq,
            )
            return decision

    @contextlib.contextmanager
    def _traced_decision(
        self, decision: ev.SharesDecided, marks: tuple[int, int, int], parent: Context | None = None
    ) -> Iterator[None]:
        """The trace of one decision: a span ``allocator.decide`` (a child of ``parent``,
        the trace of the event that caused the decision, else a root) from the start of
        the decision (``marks``: wall ns at start, view built, policy done), with the
        phases ``allocator.view`` and ``allocator.policy`` as children, current inside
        the block (the publish carries it on to the placer); logs get the epoch and
        trace id. Made only for decisions that are published, so a no-op evaluation
        leaves no trace."""
        t0, t1, t2 = marks
        attributes = {
            "shoal.epoch": decision.epoch,
            "shoal.trigger": decision.trigger,
            "shoal.jobs": len(decision.shares),
            "shoal.gpus": sum(decision.shares.values()),
        }
        root = self.tracer.start_span(
            "allocator.decide", context=parent or Context(), attributes=attributes, start_time=t0
        )
        inside = trace.set_span_in_context(root)
        self.tracer.start_span("allocator.view", context=inside, start_time=t0).end(end_time=t1)
        self.tracer.start_span("allocator.policy", context=inside, start_time=t1).end(end_time=t2)
        with (
            trace.use_span(root, end_on_exit=True),
            bound_job(epoch=decision.epoch, trigger=decision.trigger),
        ):
            yield

    async def _decide_due(self) -> None:
        """Decide for every pending trigger second and periodic wake-up, in time order.

        The triggers pending within one second of virtual time (a burst of arrivals, a
        completion and the arrival it makes room for) make one decision, as of the
        newest of them: the simulator's rule ("after all events of that virtual
        second"). With a wall clock this is what keeps a burst of a thousand
        submissions from becoming a thousand decisions.
        """
        while True:
            if self._campaign is not None and self._campaign.due():
                # A long run of decisions must not let the lease lapse: renew first.
                self.dirty.set()
                return
            self.pending.sort(key=lambda p: p[0])
            t_trig = self.pending[0][0] if self.pending else None
            wake = self._wakeup_at()
            if wake is not None and wake <= self.clock.now() and (t_trig is None or wake < t_trig - 1e-9):
                await self.decide_once("tick", at=wake)
                self.last_decision_at = max(self.last_decision_at, wake)
                self._hold_wakeup()
                continue
            if t_trig is None:
                self._hold_wakeup()
                return
            second_ends = math.floor(t_trig + 1e-9) + 1.0
            batch = [p for p in self.pending if p[0] < second_ends]
            self.pending = self.pending[len(batch) :]
            kinds = {p[1] for p in batch}
            trigger = next((k for k in ("arrival", "completion") if k in kinds), batch[-1][1])
            at = batch[-1][0]
            cause = batch[-1][2]
            trigger_seq = self._trigger_seq.get(cause or "", 0)
            for p in batch:
                self._trigger_seq.pop(p[2] or "", None)
            await self.decide_once(trigger, at=at, causation_id=cause, trigger_seq=trigger_seq)
            self.last_decision_at = max(self.last_decision_at, at)
            # Hold the clock at the next periodic decision, then let go of the holds of
            # the events this decision took in (it is published under a hold of its own
            # by now). Not of events that arrived meanwhile: they are still pending.
            self._hold_wakeup()
            release(self.clock, *(p[3] for p in batch if p[3] is not None))

    def _hold_wakeup(self) -> None:
        """With a synchronized clock, hold it at the next periodic decision (moved
        whenever that instant moves, or the clock would wait for a decision this
        allocator no longer plans)."""
        wake = self._wakeup_at() if self.is_leader else None
        if wake != self._wake_held:
            if wake is None:
                release(self.clock, "wake:allocator")
            else:
                hold(self.clock, "wake:allocator", wake, ttl_s=None)
            self._wake_held = wake

    async def _mark_lost_nodes(self) -> None:
        """Publish ``NodeLost`` for the nodes :func:`shoal.cluster.lost_nodes` judges lost.

        At most every ``min(1, node_timeout_s/4)`` wall seconds, this reads the newest
        heartbeat of every node the folded log has up (one direct get each), with the
        clock instant read just before as ``read_at``; of each node it keeps the newest
        stamp read so far, and a node it never read a heartbeat of gets one timeout from
        its first look (:func:`shoal.cluster.remember_beats`). A node is declared once
        per heartbeat stamp (the ``NodeLost`` may not be folded by the next check).
        """
        if self.node_timeout_s is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._liveness_due:
            return
        self._liveness_due = loop.time() + min(1.0, self.node_timeout_s / 4)
        state = self.projection.state
        up = [n for n, node in state.nodes.items() if node.status == NODE_UP]
        if not up:
            return
        read_at = self.clock.now()
        read = await self.bus.latest_beats(up, dead_letter=True)
        beats = remember_beats(self._beats, read, up, read_at=read_at)
        state = self.projection.state
        timeout = self.node_timeout_s * getattr(self.clock, "scale", 1.0)
        for node_id in lost_nodes(state, beats, read_at=read_at, timeout_s=timeout):
            stamp = max(state.nodes[node_id].last_heartbeat_at, beats.get(node_id, -math.inf))
            if self._declared.get(node_id) == stamp:
                continue
            self._declared[node_id] = stamp
            await self.bus.publish(
                codec.wrap(ev.NodeLost(node_id=node_id, reason="missed heartbeats"), at=self.clock.now())
            )
            log.warning("node_lost", node_id=node_id, last_heartbeat_at=stamp, read_at=read_at)

    async def _restore_decision_cursor(self) -> None:
        """Read the stream sequence of the newest message on the decision subject (for
        the expected-sequence append, whatever that message holds) and the instant of
        the newest ``SharesDecided`` that decodes. The listeners see only the events
        after a snapshot; without this, an allocator restored from a snapshot would
        append with a stale expected sequence and never get a decision in."""
        last, valid = await self.bus.last_valid_on_subject(self._decisions_subject)
        self.decisions_seq = max(self.decisions_seq, last)
        if valid is not None:
            self.last_decision_at = max(self.last_decision_at, valid[1].at)

    async def _maybe_snapshot(self) -> None:
        """Write the cluster snapshot when due (see :attr:`snapshot_interval_s`)."""
        folded = self.projection.last_seq - self._snapshot_seq
        now = time.monotonic()
        if not snapshot_due(folded, now - self._snapshot_at, self.snapshot_every, self.snapshot_interval_s):
            return
        self._snapshot_at = now
        try:
            self._snapshot_seq = await self.projection.save_snapshot()
        except Exception as exc:  # a missed snapshot costs only a longer replay later
            log.warning("snapshot_failed", error=repr(exc))
            return
        self.snapshots += 1
        log.info("snapshot_saved", snapshot=CLUSTER_SNAPSHOT, seq=self._snapshot_seq)

    # -- the loop -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log; while holding the lease, decide on churn. Returns when ``stop`` is set."""
        await self.projection.start()
        await self.projection.wait_ready()
        self._snapshot_seq = self.projection.snapshot_seq
        await self._restore_decision_cursor()
        if self._instant < self.last_decision_at:
            # Restored from a snapshot: the decisions before it were not seen one by
            # one; the newest one's inputs are the best known "before" for its instant.
            state = self.projection.state
            current = (
                dict(state.shares),
                {j: state.jobs[j].gpu_type for j in state.shares},
                dict(state.policy_memory),
            )
            self._instant, self._in_force, self._before = self.last_decision_at, current, current
        campaign = self._campaign = Campaign(
            await self.bus.lease("allocator", self.holder, ttl_s=self.lease_ttl_s)
        )
        try:
            while not stop.is_set():
                flip = await campaign.poll()
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if flip == "elected":
                    # A new leader re-reads the log to its end before deciding.
                    await self.projection.wait_for(await self.bus.last_seq())
                    self.asof = copy_state(self.projection.state)
                    self.buffer.clear()
                    # One decision on everything; the holds of what was pending go with it.
                    at = max(self.clock.now(), self.last_decision_at)
                    keys = [p[3] for p in self.pending if p[3] is not None]
                    self.pending = [(at, "takeover", None, None), *((at, "takeover", None, k) for k in keys)]
                    self.dirty.set()
                wait = campaign.until_due()
                self._hold_wakeup()
                wake = self._wakeup_at() if self.is_leader else None
                scale = getattr(self.clock, "scale", 1.0)
                if wake is not None:
                    wait = min(wait, max(0.0, (wake - self.clock.now()) / scale))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.dirty.wait(), wait)
                # After the wait (a pause may have outlived the lease): lead only if still valid.
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if not self.is_leader:
                    continue
                await self._mark_lost_nodes()
                if self.dirty.is_set():
                    if self.coalesce_s > 0:
                        await asyncio.sleep(self.coalesce_s)  # let a burst land first
                    self.dirty.clear()
                await self._decide_due()
                await self._maybe_snapshot()
        finally:
            await campaign.release()
            await self.projection.stop()


def describe(decision: ev.SharesDecided) -> dict[str, Any]:
    return {"epoch": decision.epoch, "shares": decision.shares, "trigger": decision.trigger}

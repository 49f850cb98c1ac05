"""profiler: turns progress reports into throughput and convergence models.

Consumes: the event log through a :class:`~shoal.projection.Projection`
(snapshot, replay of the rest, then the live tail). ``ProgressReported`` is folded
into a :class:`~shoal.profiling.ProfileBook` (per job, per GPU type, per GPU count:
the average of recent samples, Gandiva_fair §3.4); the profiler's own
``ThroughputModelUpdated``/``ConvergenceEstimated`` are folded too, so it knows
what it last published and when.

Snapshot: the cluster snapshot every other service starts from does not hold the
progress reports the book needs, so the profiler keeps its own
(:mod:`shoal.profiling.snapshot`: the book's measurements, the cluster state it folds,
its cursors and the stream sequence, object ``profiler`` in the
``<TOKEN>_PROFILER_SNAPSHOTS`` object store). The leader writes it once
``snapshot_every`` messages were folded since the last one, or ``snapshot_interval_s``
wall seconds after it if any was (``snapshot_saved``). Every profiler, leader or
standby, starts from the newest one that passes
:func:`~shoal.profiling.snapshot.check_profiler_snapshot` and folds only the messages
after it; a missing one (``snapshot_missing``) or one that does not pass
(``snapshot_ignored`` with the reason: unreadable, digest mismatch, other schema,
other parameters, past the stream's end) means a replay of the whole log.

Decides: :func:`shoal.profiling.throughput_update` (measured averages, Optimus
§3.2 NNLS speed fit adapted to all-reduce, AFS §4.5 overestimate for the counts
not yet measured) and :func:`shoal.profiling.convergence_update` (Optimus §3.1),
then :mod:`shoal.profiling.ratelimit`: the first model at once, later ones at
most once per ``min_interval_s`` of the injected clock per (job, GPU type) and
only on material change.

Measurement window (AFS §4.5, "it takes the throughput measurement with all
allocatable units"): a report's rate counts only once the job has run
``min_interval_s`` at the report's GPU count since the end of its newest
reconfiguration (its ``ReconfigurationCompleted``), rounded up to a whole second as
in the simulator (``SimConfig.measure_s``): a report made earlier (the hand-over
report of a share cut short, the first reports after a change) is folded for its loss
only. A job whose ``ReconfigurationCompleted`` this profiler did not fold (one that
started before a snapshot it started from) has no window. ``min_interval_s=0``: every
report counts.

Generation (heterogeneous clusters): a report that names no ``gpu_type`` (the emulated
trainer's) is filed under the generation the job ran on since its newest
``ReconfigurationCompleted`` this profiler folded, not the one its newest decision gives
it: a move to another generation (a trade or a migration, Gandiva_fair §3.4-3.5)
changes the job's generation in the folded state at once, while the old leader's
hand-over report still measures the old one. A job whose reconfiguration this profiler
did not fold takes its current generation, as before.

Synchronized clock (emulation, :class:`shoal.clock.SharedClock`): the leader holds
the clock at the end of a job's window (``measure:<job>``) while the job runs at a GPU
count it has not measured, so virtual time cannot pass a measurement before it is
published; the allocator takes that hold at the decision that gives the count, this
profiler moves it to ``decision + min_interval_s`` when it folds the decision, then to
the window's end when it folds the ``ReconfigurationCompleted``, and lets go once it
has published the count (or the job's share changed, or the job ended). Each
``ThroughputModelUpdated`` goes out under a hold the allocator releases once it has
decided on it (``model:<job>:<gpu type>``).

Publishes: ``ThroughputModelUpdated`` and ``ConvergenceEstimated`` on the job's
subject, with

- a deterministic event id ``profile-<kind>-<job>-<gpu type>-<seq>`` (``seq``: the
  stream sequence of the newest report the model includes), so a restarted or
  racing profiler that proposes the same update is deduplicated by
  ``Nats-Msg-Id``;
- ``Nats-Expected-Last-Subject-Sequence`` = the newest such event it has folded,
  so a deposed leader with a stale view cannot append (it re-reads instead).

Exactly one profiler publishes at a time (leader lease ``profiler`` in JetStream
KV); standbys fold the log and take over when the lease lapses, after reading the
log to its end.
"""

from __future__ import annotations

import asyncio
import re
import time

import structlog
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus, Campaign, ConcurrencyConflict, SkippedMessage, Snapshot
from shoal.clock import HOLD_TTL_S, Clock, hold, measure_key, model_key, release
from shoal.events import Envelope
from shoal.profiling import ProfileBook, ProfileParams, Reason, convergence_update, throughput_update
from shoal.profiling.ratelimit import MIN_INTERVAL_S, TOO_SOON, is_publish, publish_decision, relative_change
from shoal.profiling.snapshot import PROFILER_SNAPSHOT, check_profiler_snapshot, encode_profiler_snapshot
from shoal.projection import Projection, snapshot_due
from shoal.reporting import measurement_window_end
from shoal.state import FINISHED_STATUSES, ClusterState

log = structlog.get_logger("shoal.profiler")

_FINISHED = (ev.JobCompleted, ev.JobFailed, ev.JobCancelled, ev.JobRejected)
_BENIGN = frozenset({Reason.NO_GPUS, Reason.NO_RATE, Reason.FINISHED_JOB})
_PROFILER_SUBJECT_ENDS = (".profile.throughput_model_updated", ".profile.convergence_estimated")
"""Ends of the subjects the profiler appends to (``<prefix>.job.<job>.<tag>``)."""


async def _wait_any(a: asyncio.Event, b: asyncio.Event, timeout: float) -> None:
    """Return when either event is set or after ``timeout`` seconds."""
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _token(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text) or "_"


class ProfilerService:
    """Leader-elected profiler. See the module docstring."""

    def __init__(
        self,
        bus: Bus,
        *,
        holder: str,
        clock: Clock,
        params: ProfileParams | None = None,
        min_interval_s: float = MIN_INTERVAL_S,
        material_change: float = 0.05,
        lease_ttl_s: float = 3.0,
        coalesce_s: float = 0.02,
        snapshot_every: int = 10_000,
        snapshot_interval_s: float = 60.0,
    ) -> None:
        self.bus = bus
        self.holder = holder
        self.clock = clock
        self.book = ProfileBook(params)
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        """The leader writes the profiler snapshot once ``snapshot_every`` messages were
        folded since the last one, or ``snapshot_interval_s`` wall seconds after it if any was."""
        self._snapshot_seq = 0
        """Sequence of the newest snapshot this profiler wrote or started from."""
        self._snapshot_at = time.monotonic()
        self.snapshots = 0
        self.min_interval_s = min_interval_s
        self.material_change = material_change
        self.lease_ttl_s = lease_ttl_s
        self.coalesce_s = coalesce_s
        self.projection = Projection(
            bus, listeners=[self._on_event], skip_listeners=[self._on_skipped], restore=self._restore_snapshot
        )
        self.dirty = asyncio.Event()
        self.is_leader = False
        self.role: str | None = None
        """``"leader"`` or ``"standby"`` once the lease was asked for (the probes' readiness)."""
        self.published = 0
        self.passes = 0
        """Completed decision passes (tests wait on it instead of sleeping)."""
        self.model_at: dict[tuple[str, str], float] = {}
        """(job, GPU type) -> occurred-at of the newest ThroughputModelUpdated in the log."""
        self.convergence_at: dict[str, float] = {}
        self.subject_seq: dict[str, int] = {}
        """Subject of a profiler event -> stream sequence of the newest message on it,
        whatever it holds (a message there that does not decode counts: the
        expected-sequence append compares with it)."""
        self._job_subjects = f"{bus.names.prefix}.job."
        self.held_back: dict[tuple[str, str], float] = {}
        """Updates due but too soon: (kind, key) -> when they may go out."""
        self.segments: dict[str, list[tuple[float, int]]] = {}
        """job -> (instant a reconfiguration completed, world size) of its two newest
        reconfigurations: the measurement windows its reports fall in (see the module
        docstring)."""
        self.ran_on: dict[str, str] = {}
        """job -> the GPU generation of its newest completed reconfiguration (the job's
        generation when its ``ReconfigurationCompleted`` was folded): where a report that
        names none was made (see :meth:`report_gpu_type`)."""
        self._shares: dict[str, int] = {}
        """The newest ``SharesDecided``'s shares."""
        self._measure_held: set[str] = set()
        """Jobs whose ``measure:<job>`` hold this profiler placed (synchronized clock)."""

    @property
    def rejected(self) -> dict[str, int]:
        """Progress reports (or parts) rejected, by reason."""
        return dict(self.book.rejected)

    # -- snapshot -----------------------------------------------------------------

    async def _restore_snapshot(self) -> tuple[str, ClusterState, int] | None:
        """Load and check the profiler snapshot; on success take its book and cursors and
        return its state and sequence for the projection (None: replay the whole log)."""
        bucket = self.bus.names.profiler_snapshot_bucket
        try:
            snap = await self.bus.load_snapshot(PROFILER_SNAPSHOT, bucket=bucket)
        except Exception as exc:  # corrupt, or cannot be read: replay
            log.warning("snapshot_ignored", snapshot=PROFILER_SNAPSHOT, reason=f"unreadable: {exc!r}")
            return None
        if snap is None:
            log.info("snapshot_missing", snapshot=PROFILER_SNAPSHOT)
            return None
        restored, reason = check_profiler_snapshot(
            snap, stream_last_seq=await self.bus.last_seq(), params=self.book.params
        )
        if restored is None:
            log.warning("snapshot_ignored", snapshot=PROFILER_SNAPSHOT, seq=snap.seq, reason=reason)
            return None
        self.book = restored.book
        self.model_at = restored.model_at
        self.convergence_at = restored.convergence_at
        self.subject_seq = restored.subject_seq
        return PROFILER_SNAPSHOT, restored.state, restored.seq

    def snapshot(self) -> Snapshot:
        """The profiler snapshot as of the projection's sequence (no await inside: the
        book, the state and the cursors are all as of that sequence)."""
        return encode_profiler_snapshot(
            seq=self.projection.last_seq,
            state=self.projection.state,
            book=self.book,
            model_at=self.model_at,
            convergence_at=self.convergence_at,
            subject_seq=self.subject_seq,
        )

    async def _maybe_snapshot(self) -> None:
        """Write the profiler snapshot when due (see :attr:`snapshot_interval_s`)."""
        folded = self.projection.last_seq - self._snapshot_seq
        now = time.monotonic()
        if not snapshot_due(folded, now - self._snapshot_at, self.snapshot_every, self.snapshot_interval_s):
            return
        self._snapshot_at = now
        snap = self.snapshot()
        try:
            await self.bus.save_snapshot(
                snap.name,
                snap.seq,
                snap.state,
                digest=snap.digest,
                schema=snap.schema,
                bucket=self.bus.names.profiler_snapshot_bucket,
            )
        except Exception as exc:  # a missed snapshot costs only a longer replay later
            log.warning("snapshot_failed", snapshot=PROFILER_SNAPSHOT, error=repr(exc))
            return
        self._snapshot_seq = snap.seq
        self.snapshots += 1
        log.info("snapshot_saved", snapshot=PROFILER_SNAPSHOT, seq=snap.seq, bytes=len(snap.state))

    # -- consuming --------------------------------------------------------------

    def window_end(self, resumed_at: float) -> float:
        """The end of a measurement window that began at ``resumed_at`` (whole seconds)."""
        return measurement_window_end(resumed_at, self.min_interval_s)

    def _in_window(self, e: ev.ProgressReported, at: float, state: ClusterState) -> bool:
        """Whether the report's rate is no measurement: made before its GPU count's
        window ended, or of a shape the job did not have at that instant (a leader that
        had not applied its newest order yet)."""
        job = state.jobs.get(e.job_id)
        segments = self.segments.get(e.job_id)
        if self.min_interval_s <= 0 or job is None or not segments:
            return False
        gpus = e.num_gpus or job.world_size or job.gpus
        start, world = segments[-1]
        if gpus == world and at >= start - 1e-9:
            return at < self.window_end(start) - 1e-9
        if len(segments) > 1 and gpus == segments[-2][1] and at <= start + 1e-9:
            # The hand-over report of the shape before the newest change.
            return at < self.window_end(segments[-2][0]) - 1e-9
        return True

    def report_gpu_type(self, e: ev.ProgressReported, state: ClusterState) -> str | None:
        """The generation a report was made on: its own ``gpu_type``, else the one the
        job ran on since its newest completed reconfiguration, else None (the book then
        takes the job's current one).

        A decision that moves a job to another generation (Gandiva_fair's trades and
        migrations, §3.4-3.5) changes the job's generation in the folded state at once,
        but the job runs on the old one until the move completes: the hand-over report
        the old leader makes when it stops measures the old generation, and filing it
        under the new one would mix two generations' rates in one measurement."""
        if e.gpu_type:
            return e.gpu_type
        return self.ran_on.get(e.job_id)

    def _unmeasured(self, job_id: str, gpus: int, state: ClusterState) -> bool:
        job = state.jobs.get(job_id)
        if job is None or job.status in FINISHED_STATUSES or gpus <= 0 or self.min_interval_s <= 0:
            return False
        return gpus not in self.book.measured(job_id, job.gpu_type or "")

    def _hold_measure(self, job_id: str, at: float | None, *, owned: bool) -> None:
        """Hold the clock at ``at`` for a job's measurement (None: let go of it), from
        the live tail on (not for the log replayed at start). Standbys hold too: a
        synchronized clock runs one profiler, which may lose its lease for a moment on a
        loaded machine and must not let the clock run meanwhile."""
        if self.role is None:
            return
        if at is None:
            self._measure_held.discard(job_id)
            release(self.clock, measure_key(job_id))
        else:
            self._measure_held.add(job_id)
            # Not owned: lapses (with a warning) if the reconfiguration never completes,
            # e.g. one whose stop outlasts the window; 3 × the usual TTL for a loaded machine.
            hold(self.clock, measure_key(job_id), at, ttl_s=None if owned else 3 * HOLD_TTL_S)

    def _on_decided(self, e: ev.SharesDecided, at: float, state: ClusterState) -> None:
        """A job whose share changed ends its window; one given an unmeasured count is
        held at ``at + min_interval_s`` until its reconfiguration completes."""
        before, self._shares = self._shares, dict(e.shares)
        for job_id in sorted(set(before) | set(e.shares)):
            gpus = e.shares.get(job_id, 0)
            if gpus == before.get(job_id, 0):
                continue
            if self._unmeasured(job_id, gpus, state):
                self._hold_measure(job_id, at + self.min_interval_s, owned=False)
            elif job_id in self._measure_held or gpus:
                self._hold_measure(job_id, None, owned=False)

    def _on_event(self, seq: int, env: Envelope, state: ClusterState) -> None:
        e = env.event
        if isinstance(e, ev.ProgressReported):
            reasons = self.book.observe(
                seq,
                e,
                env.at,
                state.jobs.get(e.job_id),
                rate=not self._in_window(e, env.at, state),
                gpu_type=self.report_gpu_type(e, state),
            )
            if reasons:
                # A paused job (0 GPUs) or a report without a rate is normal; nonsense is not.
                emit = log.debug if set(reasons) <= _BENIGN else log.warning
                emit("progress_rejected", job_id=e.job_id, reasons=[r.value for r in reasons], stream_seq=seq)
            self.dirty.set()
        elif isinstance(e, ev.ThroughputModelUpdated):
            self.model_at[(e.job_id, e.gpu_type)] = env.at
            self.subject_seq[self.bus.names.subject(e)] = seq
        elif isinstance(e, ev.ConvergenceEstimated):
            self.convergence_at[e.job_id] = env.at
            self.subject_seq[self.bus.names.subject(e)] = seq
        elif isinstance(e, ev.SharesDecided):
            self._on_decided(e, env.at, state)
        elif isinstance(e, ev.ReconfigurationCompleted):
            job = state.jobs.get(e.job_id)
            if job is not None and job.reconf_epoch == e.epoch:
                self.segments[e.job_id] = [*self.segments.get(e.job_id, [])[-1:], (env.at, e.world_size)]
                self.ran_on[e.job_id] = job.gpu_type or ""
                if self._unmeasured(e.job_id, e.world_size, state):
                    self._hold_measure(e.job_id, self.window_end(env.at), owned=True)
                elif e.job_id in self._measure_held:
                    self._hold_measure(e.job_id, None, owned=True)
        elif isinstance(e, _FINISHED):
            self.segments.pop(e.job_id, None)
            self.ran_on.pop(e.job_id, None)
            self._shares.pop(e.job_id, None)
            if e.job_id in self._measure_held:
                self._hold_measure(e.job_id, None, owned=True)
            self.book.forget(e.job_id)
            self.model_at = {k: v for k, v in self.model_at.items() if k[0] != e.job_id}
            self.convergence_at.pop(e.job_id, None)

    def _on_skipped(self, skipped: SkippedMessage) -> None:
        subject = skipped.subject
        if subject.startswith(self._job_subjects) and subject.endswith(_PROFILER_SUBJECT_ENDS):
            self.subject_seq[subject] = max(self.subject_seq.get(subject, 0), skipped.seq)

    # -- deciding ---------------------------------------------------------------

    def plan(self, now: float) -> list[Envelope]:
        """The updates to publish now, as envelopes with deterministic ids (no I/O).

        Also records held-back updates in :attr:`held_back` and clears what it
        examined from the book's dirty sets.
        """
        state = self.projection.state
        book = self.book
        out: list[Envelope] = []
        # Rebuilt every pass: whatever is still too soon is re-added below.
        self.held_back = {}
        for job_id, gpu_type in sorted(book.dirty_models):
            job = state.jobs.get(job_id)
            book.dirty_models.discard((job_id, gpu_type))
            if job is None or job.status in FINISHED_STATUSES:
                continue
            cand = throughput_update(book, job_id, gpu_type, job)
            if cand is None:
                continue
            last = job.throughput_models.get(gpu_type)
            published = dict(last.throughput) if last is not None else {}
            # A count measured for the first time is news for the allocator even when the
            # estimate had its value right (§4.5: it moves the job to its next unit).
            flag = last is not None and (
                last.overestimated != cand.overestimated
                or last.model_kind != cand.model_kind
                or (cand.overestimated and tuple(last.measured) != cand.measured)
            )
            last_at = self.model_at.get((job_id, gpu_type)) if last is not None else None
            # A count measured for the first time waited out its own measurement window
            # (see the module docstring): the allocator's next §4.5 step waits for it.
            new_count = last is not None and bool(set(cand.measured) - set(last.measured))
            decision = publish_decision(
                now=now,
                last_at=last_at,
                change=relative_change(published, cand.throughput),
                flag_changed=flag,
                min_interval_s=0.0 if new_count else self.min_interval_s,
                material_change=self.material_change,
            )
            if decision == TOO_SOON and last_at is not None:
                book.dirty_models.add((job_id, gpu_type))
                self.held_back[("model", f"{job_id}/{gpu_type}")] = last_at + self.min_interval_s
            if is_publish(decision):
                basis = book.basis.get((job_id, gpu_type), 0)
                eid = f"profile-tm-{_token(job_id)}-{_token(gpu_type)}-{basis}"
                out.append(codec.wrap(cand, at=now, event_id=eid))
        for job_id in sorted(book.dirty_convergence):
            job = state.jobs.get(job_id)
            book.dirty_convergence.discard(job_id)
            if job is None or job.status in FINISHED_STATUSES:
                continue
            conv = convergence_update(book, job_id, job)
            if conv is None:
                continue
            if isinstance(conv, Reason):
                book.rejected[conv.value] += 1
                continue
            old = job.convergence
            last_at = self.convergence_at.get(job_id) if old is not None else None
            change = (
                relative_change(
                    {0: float(old.estimated_total_iterations)}, {0: float(conv.estimated_total_iterations)}
                )
                if old is not None
                else 0.0
            )
            decision = publish_decision(
                now=now,
                last_at=last_at,
                change=change,
                flag_changed=False,
                min_interval_s=self.min_interval_s,
                material_change=self.material_change,
            )
            if decision == TOO_SOON and last_at is not None:
                book.dirty_convergence.add(job_id)
                self.held_back[("convergence", job_id)] = last_at + self.min_interval_s
            if is_publish(decision):
                basis = book.loss_basis.get(job_id, 0)
                eid = f"profile-conv-{_token(job_id)}-{basis}"
                out.append(codec.wrap(conv, at=now, event_id=eid))
        return out

    async def decide_once(self) -> int:
        """Plan and publish; returns how many updates were appended."""
        envs = self.plan(self.clock.now())
        appended = 0
        newest = 0
        for env in envs:
            job_id = getattr(env.event, "job_id", "")
            expected = self.subject_seq.get(self.bus.names.subject(env.event), 0)
            model = env.event if isinstance(env.event, ev.ThroughputModelUpdated) else None
            if model is not None:
                # The allocator releases it once it has decided on this model.
                hold(self.clock, model_key(model.job_id, model.gpu_type))
            try:
                result = await self.bus.publish(env, expected_last_subject_seq=expected)
            except ConcurrencyConflict:
                if model is not None:
                    release(self.clock, model_key(model.job_id, model.gpu_type))
                # Another profiler appended first: re-read the log, decide again later.
                log.warning("profile_conflict", job_id=job_id, event_id=env.id)
                await self.projection.wait_for(await self.bus.last_seq())
                self.dirty.set()
                continue
            # Fold our own write before the next one on the same subject.
            await self.projection.wait_for(result.seq)
            newest = max(newest, result.seq)
            segment = self.segments.get(job_id, [])[-1:]
            if (
                model is not None
                and job_id in self._measure_held
                and segment
                and segment[0][1] in model.measured
            ):
                self._hold_measure(job_id, None, owned=True)
            if not result.duplicate:
                appended += 1
            log.info(
                "profile_published",
                event_type=env.type,
                job_id=job_id,
                event_id=env.id,
                stream_seq=result.seq,
                duplicate=result.duplicate,
            )
        self.published += appended
        self.passes += 1
        return appended

    # -- the loop -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log; while holding the lease, publish due updates. Returns when ``stop`` is set."""
        await self.projection.start()
        await self.projection.wait_ready()
        self._snapshot_seq = self.projection.snapshot_seq
        campaign = Campaign(await self.bus.lease("profiler", self.holder, ttl_s=self.lease_ttl_s))
        scale = float(getattr(self.clock, "scale", 1.0))
        try:
            while not stop.is_set():
                flip = await campaign.poll()
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if flip == "elected":
                    await self.projection.wait_for(await self.bus.last_seq())
                    self.dirty.set()
                wait = campaign.until_due()
                if self.held_back:
                    due = min(self.held_back.values())
                    wait = min(wait, max(0.0, (due - self.clock.now()) / scale))
                await _wait_any(self.dirty, stop, wait)
                # After the wait (a pause may have outlived the lease): lead only if still valid.
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if not self.is_leader:
                    # A standby only folds; taking over re-examines everything.
                    self.dirty.clear()
                    continue
                due_now = bool(self.held_back) and min(self.held_back.values()) <= self.clock.now()
                if self.dirty.is_set() or due_now:
                    await asyncio.sleep(self.coalesce_s)  # let a burst of reports land first
                    self.dirty.clear()
                    await self.decide_once()
                await self._maybe_snapshot()
        finally:
            await campaign.release()
            await self.projection.stop()

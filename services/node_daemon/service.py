"""node-daemon: one per machine; presents its GPUs and runs the sidecars placed on it.

Consumes: the event log through a :class:`~shoal.projection.Projection`; acts on
the placement of the newest epoch (``PlacementDecided``) and on job ends.

Decides: nothing of policy; it reconciles. For every job with GPUs on this node
at the newest placement it keeps one sidecar process and sends it a
``Reconfigure(job, epoch, gpus)`` order when the job's GPU set changed; a job that
left the node, finished or was cancelled has its sidecar stopped. Reconciliation is
level-triggered: a missed message is repaired by the next one.

Publishes: ``NodeRegistered`` at start; ``NodeHeartbeat`` every ``heartbeat_s`` (never
faster: the next one is sent ``heartbeat_s`` after the previous one went out; a failed
publish, e.g. while the NATS server is down, restarts the heartbeat loop after a backoff,
:func:`shoal.tasks.keep_running`) to the beats stream, which keeps at most eight of each
node's, each for ``Nats-TTL`` = twice ``heartbeat_s`` (:func:`shoal.bus.beat_ttl_s`), and
refuses a node's next one while it holds eight (the per-node rate limit; a refused
heartbeat is logged at debug and the loop goes on: the previous ones are still stored)
(:meth:`shoal.bus.Bus.publish_beat`), never to the event log;
``GpuHealth`` for a GPU when its reading changed since the last one published (health,
or utilisation by a step of :func:`utilisation_step`: NVML readings, or for emulated GPUs
1.0 while a job holds the GPU and 0.0 otherwise), checked every ``health_every``
heartbeats, so an idle or steadily busy node appends nothing to the log (issue 21,
bounded log growth).

Coming back after being declared lost: when the log (this daemon's projection) says
this node is lost — its heartbeats did not reach the log in time: the daemon was
stopped, its host or network stalled — the daemon registers again at its next
heartbeat: ``NodeRegistered`` makes the node up again in the fold, with its GPUs, and
the allocator and placer decide again on it (a node change). The jobs it ran were
given GPUs elsewhere when it was lost, and its sidecars stop as the placement tells
them to, so the node comes back empty. A re-registration is published once per loss:
not again until the projection has folded it.

Sidecars are supervised subprocesses: orders go to their stdin (closing it stops
them), they stop with the daemon (end of stdin), and a sidecar that exits
while its job still needs it is restarted and re-sent its order.

Spare sidecars (``spares``, default 1): the daemon keeps that many sidecars started
for no job yet (``--job -``; see ``shoal_services.trainer_sidecar.__main__``). A job
placed on this node takes a spare, which learns its job id from one stdin line and
is running within milliseconds, and a new spare is started in the background once
no job has been placed here for a second. A
cold start costs the interpreter, imports and NATS connection: 0.3–1 s on an idle
2-core machine, and far more when a decision moves many jobs at once. In real mode
that is time-to-first-step after a placement; in emulation at 1000× it is hundreds
of virtual seconds during which the job's new leading sidecar cannot report or
complete (what made emulate-mode decision sequences drift from the simulator's).
A spare that dies is replaced at the next heartbeat; spares stop with the daemon.

Synchronized clock (emulation, :class:`shoal.clock.SharedClock`): each order is sent
under a hold the sidecar releases once it has applied it; the placement's hold on
this node goes once its orders are sent, and the holds of a sidecar that stopped or
died before applying its orders go with it.

Tracing: a reconciliation that acts continues the trace of the placement it carries
out, taken from the stored headers of that ``PlacementDecided`` (the daemon reads the
log through a projection): span ``node_daemon.reconcile`` with ``node_daemon.spawn``
and, per order, ``node_daemon.reconfigure``. The order's line on the sidecar's stdin
carries that span's W3C ``traceparent`` (and ``tracestate``) as extra fields, so the
sidecar's spans continue the same trace; a sidecar that does not know the fields
ignores them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Callable, Sequence

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AnyValue
from prometheus_client import Gauge
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus, RateLimited, beat_ttl_s
from shoal.clock import Clock, hold, release
from shoal.events import Envelope, GpuRef
from shoal.gpus import read_nvml
from shoal.log import bound_job
from shoal.projection import CLUSTER_SNAPSHOT, Projection
from shoal.state import FINISHED_STATUSES, NODE_LOST, ClusterState
from shoal.tasks import keep_running
from shoal.telemetry import stored_context, tracing_enabled, with_trace_fields
from shoal_services.trainer_sidecar import SIDECAR_TOKEN, SPARE_JOB, adoption_line

log = structlog.get_logger("shoal.node_daemon")


GPU_UTILIZATION = Gauge(
    "shoal_node_gpu_utilization",
    "Each GPU's utilisation as this node daemon last read it (NVML; an emulated GPU reads 1 "
    "while a job holds it, else 0), in [0, 1].",
    ["gpu"],
)

SidecarArgv = Callable[[str], Sequence[str]]


class Sidecar:
    """A supervised sidecar process for one job on this node."""

    def __init__(self, job_id: str, proc: asyncio.subprocess.Process) -> None:
        self.job_id = job_id
        self.proc = proc
        self.epoch = 0
        self.gpus: tuple[GpuRef, ...] = ()
        self.holds: list[str] = []
        """Keys of the clock holds its orders were sent under (a synchronized clock):
        the sidecar releases each once applied; whatever is left when the process is
        gone (stopped before it got to them, or died) the daemon releases."""

    async def send(self, order: ev.Reconfigure) -> None:
        """Write ``order`` as one JSON line, with the current trace context (if any)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(with_trace_fields(codec.to_json(order)) + b"\n")
        await self.proc.stdin.drain()
        self.epoch, self.gpus = order.epoch, order.gpus

    async def stop(self, timeout_s: float = 5.0, grace_s: float = 2.0) -> None:
        """End of stdin asks the sidecar to finish its orders and exit; SIGTERM after
        ``grace_s``, SIGKILL after ``timeout_s`` more."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), grace_s)
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


def utilisation_step(util: float) -> float:
    """The step of a GPU's utilisation (0..1) whose change makes a new ``GpuHealth``.

    Quarter steps, except that idle (0) and lightly used (above 0, under 1/8) are steps
    of their own: with plain quarters a GPU that a job keeps 8 % busy rounds to the idle
    step, and ``shoal nodes`` showed 0 % all along (seen on an H100 running
    ``examples/cnn_digits.py`` at 7–11 % by nvidia-smi).
    """
    step = round(util * 4) / 4
    return 0.125 if step == 0 and util > 0 else step


class NodeDaemon:
    """See the module docstring."""

    def __init__(
        self,
        bus: Bus,
        node_id: str,
        gpus: tuple[ev.GpuInfo, ...],
        *,
        clock: Clock,
        sidecar_argv: SidecarArgv,
        emulated: bool = True,
        heartbeat_s: float = 1.0,
        health_every: int = 5,
        hostname: str = "",
        spares: int = 1,
        tracer: trace.Tracer | None = None,
        projection: Projection | None = None,
        mint_token: Callable[[str, int], str] | None = None,
    ) -> None:
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.bus = bus
        self.tracer = tracer or trace.get_tracer("shoal.node_daemon")
        self.node_id = node_id
        self.gpus = gpus
        self.clock = clock
        self.sidecar_argv = sidecar_argv
        self.mint_token = mint_token
        """``(job_id, log sequence) -> token`` of the job's sidecar on this node
        (:mod:`shoal.callout`); None: sidecars authenticate as the environment says."""
        self.emulated = emulated
        self.heartbeat_s = heartbeat_s
        self.health_every = health_every
        self._beat = 0
        self._health_sent: dict[int, tuple[bool, float]] = {}
        """GPU index -> (healthy, :func:`utilisation_step`) of the newest ``GpuHealth``
        published since this node's newest registration (which resets the fold's)."""
        self.hostname = hostname
        if projection is None:
            projection = Projection(bus, snapshot_name=CLUSTER_SNAPSHOT)
        projection.add_listener(self._on_event)
        self.projection = projection
        """The log as this service sees it; may be shared with services of the same
        process (see :mod:`shoal.projection`)."""
        self.sidecars: dict[str, Sidecar] = {}
        self.spares = spares
        self._spares: list[asyncio.subprocess.Process] = []
        """Started sidecars waiting for a job (oldest first)."""
        self._warm: set[asyncio.subprocess.Process] = set()
        """The spares that said they are ready (by process, not pid: pids are reused)."""
        self._refill: asyncio.Task[None] | None = None
        self.refill_after_s = 1.0
        """Wall seconds without an adoption before spares are started again."""
        self._adopted_at = -math.inf
        self._closing = False
        self._stopping: set[asyncio.Task[None]] = set()
        """Sidecars on their way out: stopped in the background, so that a sidecar
        finishing its last orders never holds up the orders of the others."""
        self.dirty = asyncio.Event()
        self.placement_decided_at = 0.0
        self.placement_seq = 0
        """Stream sequence of the newest placement (its stored headers carry its trace)."""
        self._held_epochs: set[int] = set()
        """Placements whose clock hold for this node is released once reconciled (a
        :class:`~shoal.clock.SharedClock` only)."""
        self._registered_seq = 0
        """Stream sequence of this daemon's newest re-registration."""
        self.reregistrations = 0

    def _on_event(self, seq: int, env: Envelope, state: ClusterState) -> None:
        if isinstance(env.event, ev.PlacementDecided):
            self._held_epochs.add(env.event.epoch)
        if isinstance(env.event, ev.PlacementDecided) and env.event.epoch >= state.placement_epoch:
            self.placement_decided_at = env.event.decided_at
            self.placement_seq = seq
        if isinstance(
            env.event, ev.PlacementDecided | ev.JobCompleted | ev.JobCancelled | ev.JobFailed | ev.NodeLost
        ):
            self.dirty.set()

    async def _publish(self, event: ev.Event) -> None:
        await self.bus.publish(codec.wrap(event, at=self.clock.now()))

    def _registration(self) -> ev.NodeRegistered:
        return ev.NodeRegistered(
            node_id=self.node_id, gpus=self.gpus, hostname=self.hostname, emulated=self.emulated
        )

    async def _register_again_if_lost(self) -> None:
        """Register again if the log says this node is lost (see the module docstring)."""
        projection = self.projection
        node = projection.state.nodes.get(self.node_id)
        if node is None or node.status != NODE_LOST or projection.last_seq < self._registered_seq:
            return
        result = await self.bus.publish(codec.wrap(self._registration(), at=self.clock.now()))
        self._registered_seq = result.seq
        self._health_sent.clear()  # the registration reset the GPUs' readings in the fold
        self.reregistrations += 1
        log.warning("node_registered_again", node_id=self.node_id, stream_seq=result.seq)

    def desired(self) -> dict[str, tuple[GpuRef, ...]]:
        """job id -> the job's full GPU set, for jobs with GPUs on this node now."""
        state = self.projection.state
        out = {}
        for job_id in state.placed:
            job = state.jobs[job_id]
            if job.status in FINISHED_STATUSES:
                continue
            if any(g.node_id == self.node_id for g in job.placement):
                out[job_id] = tuple(job.placement)
        return out

    async def _spawn(self, job_id: str) -> Sidecar:
        with self.tracer.start_as_current_span(
            "node_daemon.spawn", attributes={"shoal.job_id": job_id}
        ) as span:
            side = await self._spawn_process(job_id)
            span.set_attribute("shoal.sidecar_pid", side.proc.pid)
            return side

    async def _send(self, side: Sidecar, order: ev.Reconfigure) -> None:
        """Send one order inside its own span, whose context rides on the order line."""
        attributes: dict[str, AnyValue] = {
            "shoal.job_id": order.job_id,
            "shoal.epoch": order.epoch,
            "shoal.node_id": self.node_id,
            "shoal.gpus": len(order.gpus),
            "shoal.sidecar_pid": side.proc.pid,
        }
        with (
            self.tracer.start_as_current_span(
                "node_daemon.reconfigure", kind=trace.SpanKind.PRODUCER, attributes=attributes
            ),
            bound_job(job_id=order.job_id, epoch=order.epoch),
        ):
            # The trainer releases it once it has applied the order (synchronized clock).
            key = f"order:{order.epoch}:{self.node_id}:{order.job_id}"
            hold(self.clock, key)
            side.holds.append(key)
            try:
                await side.send(order)
            except BaseException:
                release(self.clock, key)
                raise
            log.info("order_sent", gpus=len(order.gpus))

    async def _start(self, job_id: str) -> asyncio.subprocess.Process:
        if job_id != SPARE_JOB:
            env = None
            if self.mint_token is not None:
                # Its own token, in its own environment (readable by this user only).
                env = {**os.environ, SIDECAR_TOKEN: self.mint_token(job_id, self.projection.last_seq)}
            return await asyncio.create_subprocess_exec(
                *self.sidecar_argv(job_id),
                env=env,
                stdin=asyncio.subprocess.PIPE,
                # No preexec_fn: it forces a slow fork that blocks this event loop for
                # a quarter of a second per sidecar. A sidecar needs no death signal:
                # when this process dies its stdin reaches end-of-file and it stops.
            )
        # A spare tells it is ready (imports done, connected) by writing to a pipe.
        r, w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.sidecar_argv(job_id), "--ready-fd", str(w), stdin=asyncio.subprocess.PIPE, pass_fds=(w,)
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        loop = asyncio.get_running_loop()

        def readable() -> None:
            loop.remove_reader(r)
            with contextlib.suppress(OSError):
                if os.read(r, 1):
                    self._warm.add(proc)
            os.close(r)

        loop.add_reader(r, readable)
        return proc

    def spares_ready(self) -> int:
        """Spares that are started and waiting for a job."""
        return sum(p.returncode is None and p in self._warm for p in self._spares)

    async def _adopt(self, job_id: str) -> asyncio.subprocess.Process | None:
        """Hand ``job_id`` to a live spare, a ready one first; ``None`` when there is none."""
        self._spares.sort(key=lambda p: p not in self._warm)  # stable: oldest ready first
        while self._spares:
            proc = self._spares.pop(0)
            self._warm.discard(proc)
            if proc.returncode is not None or proc.stdin is None:
                continue
            try:
                token = self.mint_token(job_id, self.projection.last_seq) if self.mint_token else ""
                proc.stdin.write(adoption_line(job_id, token))
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                continue  # it died just now; the next one, or a cold start
            self._adopted_at = asyncio.get_running_loop().time()
            return proc
        return None

    def _refill_spares(self) -> None:
        """Top the spares up to ``spares`` in the background (one refill at a time)."""
        if self._closing or (self._refill is not None and not self._refill.done()):
            return

        async def refill() -> None:
            loop = asyncio.get_running_loop()
            while not self._closing:
                # Not while jobs are being placed here: a process start is half a second
                # of CPU that the services placing them need more.
                quiet = self._adopted_at + self.refill_after_s - loop.time()
                if quiet <= 0:
                    break
                await asyncio.sleep(quiet)
            self._spares = [p for p in self._spares if p.returncode is None]
            self._warm.intersection_update(self._spares)
            while not self._closing and len(self._spares) < self.spares:
                proc = await self._start(SPARE_JOB)
                if self._closing:
                    await Sidecar(SPARE_JOB, proc).stop()
                    return
                self._spares.append(proc)
                log.info("spare_sidecar_started", pid=proc.pid)

        self._refill = asyncio.create_task(refill())

    async def _stop_spares(self) -> None:
        self._closing = True
        if self._refill is not None:
            await asyncio.gather(self._refill, return_exceptions=True)
        spares, self._spares = self._spares, []
        await asyncio.gather(*(Sidecar(SPARE_JOB, p).stop() for p in spares), return_exceptions=True)

    async def _spawn_process(self, job_id: str) -> Sidecar:
        proc = await self._adopt(job_id)
        how = "spare"
        if proc is None:
            proc, how = await self._start(job_id), "cold"
        self._refill_spares()
        log.info("sidecar_started", job_id=job_id, pid=proc.pid, start=how)
        return Sidecar(job_id, proc)

    async def _stop(self, job_id: str, side: Sidecar) -> None:
        await side.stop()
        release(self.clock, *side.holds)
        log.info("sidecar_stopped", job_id=job_id)

    async def reconcile(self) -> None:
        epoch = self.projection.state.placement_epoch
        try:
            await self._reconcile()
        finally:
            # The orders of this placement (and of any it superseded) are sent, each
            # under a hold of its own: the placement's hold on this node goes.
            done = [e for e in self._held_epochs if e <= epoch]
            if done:
                self._held_epochs.difference_update(done)
                release(self.clock, *(f"place:{e}:{self.node_id}" for e in done))

    async def _reconcile(self) -> None:
        state = self.projection.state
        # Read everything an order carries now: spawning and sending yield to the event
        # loop, and the state may move on meanwhile (the next reconciliation sends that).
        desired = self.desired()
        epoch = state.placement_epoch
        decided_at = self.placement_decided_at or None
        placement_seq = self.placement_seq
        placements = {j: tuple(job.placement) for j, job in state.jobs.items() if j in self.sidecars}
        finished = {j for j in self.sidecars if j in state.jobs and state.jobs[j].status in FINISHED_STATUSES}
        leaving = [(j, self.sidecars.pop(j)) for j in list(self.sidecars) if j not in desired]
        acting = bool(leaving) or any(
            (side := self.sidecars.get(j)) is None or side.proc.returncode is not None or side.gpus != gpus
            for j, gpus in desired.items()
        )
        if not acting:
            return
        parent = Context()
        if tracing_enabled(self.tracer):
            parent = await stored_context(self.bus.js, self.bus.names.events_stream, placement_seq)
        attributes: dict[str, AnyValue] = {"shoal.epoch": epoch, "shoal.node_id": self.node_id}
        with (
            self.tracer.start_as_current_span(
                "node_daemon.reconcile", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
            ),
            bound_job(epoch=epoch),
        ):
            await self._act(epoch, decided_at, desired, placements, finished, leaving)

    async def _act(
        self,
        epoch: int,
        decided_at: float | None,
        desired: dict[str, tuple[GpuRef, ...]],
        placements: dict[str, tuple[GpuRef, ...]],
        finished: set[str],
        leaving: list[tuple[str, Sidecar]],
    ) -> None:
        for job_id, side in leaving:
            if job_id in placements and job_id not in finished and side.proc.returncode is None:
                # The job left this node (moved or preempted): the last order tells
                # the sidecar so, and it hands the job's progress over before exiting.
                with contextlib.suppress(Exception):
                    await self._send(
                        side,
                        ev.Reconfigure(
                            job_id=job_id, epoch=epoch, gpus=placements[job_id], effective_at=decided_at
                        ),
                    )
        for job_id, side in leaving:
            task = asyncio.create_task(self._stop(job_id, side))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        for job_id, gpus in desired.items():
            running = self.sidecars.get(job_id)
            if running is not None and running.proc.returncode is not None:
                log.warning("sidecar_died", job_id=job_id, returncode=running.proc.returncode)
                release(self.clock, *running.holds)
                running = None
            if running is None:
                running = self.sidecars[job_id] = await self._spawn(job_id)
            if running.gpus != gpus:
                await self._send(
                    running, ev.Reconfigure(job_id=job_id, epoch=epoch, gpus=gpus, effective_at=decided_at)
                )

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._beat += 1
            beat = self._beat
            try:
                await self.bus.publish_beat(
                    codec.wrap(ev.NodeHeartbeat(node_id=self.node_id, seq=beat), at=self.clock.now()),
                    ttl_s=beat_ttl_s(self.heartbeat_s),
                )
            except RateLimited:
                # Sent early (after a restart of this loop, or a beat that came early on
                # the stream's one-second wheel): the previous heartbeat is still stored.
                log.debug("heartbeat_rate_limited", beat=beat)
            await self._register_again_if_lost()
            if beat % self.health_every == 1 or self.health_every == 1:
                busy = {
                    g.index for gpus in self.desired().values() for g in gpus if g.node_id == self.node_id
                }
                healths = []
                sent: dict[int, tuple[bool, float]] = {}
                for gpu in self.gpus:
                    reading = None if self.emulated else read_nvml(gpu.index)
                    log.debug("gpu_read", index=gpu.index, nvml=reading, busy=gpu.index in busy)
                    util, mem, temp = reading if reading else (1.0 if gpu.index in busy else 0.0, 0, 0.0)
                    GPU_UTILIZATION.labels(gpu=str(gpu.index)).set(util)
                    key = (True, utilisation_step(util))
                    if self._health_sent.get(gpu.index) == key:
                        continue  # nothing new for the log
                    sent[gpu.index] = key
                    healths.append(
                        codec.wrap(
                            ev.GpuHealth(
                                node_id=self.node_id,
                                index=gpu.index,
                                utilization=util,
                                memory_used_mb=mem,
                                temperature_c=temp,
                            ),
                            at=self.clock.now(),
                        )
                    )
                if healths:
                    await self.bus.publish_many(healths)
                    self._health_sent.update(sent)  # once stored (a failed publish is retried)
            # Sidecars that died get restarted at the next reconciliation; spares that
            # died are replaced.
            if any(s.proc.returncode is not None for s in self.sidecars.values()):
                self.dirty.set()
            if sum(p.returncode is None for p in self._spares) < self.spares:
                self._refill_spares()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.heartbeat_s)

    async def run(self, stop: asyncio.Event) -> None:
        # A node may start before any service has declared the streams (or while the
        # cluster elects their leaders): it waits, not ready, rather than failing its
        # registration and exiting (Bus.wait_for_stream).
        await self.bus.wait_for_stream()
        await self._publish(self._registration())
        await self.projection.start()
        await self.projection.wait_ready()
        if self.projection.restored_from_snapshot and not self.placement_seq:
            # The listener saw only the tail: the newest placement's instant and trace.
            subject = f"{self.bus.names.prefix}.alloc.placement_decided"
            _, valid = await self.bus.last_valid_on_subject(subject)
            if valid is not None and isinstance(valid[1].event, ev.PlacementDecided):
                self.placement_seq, self.placement_decided_at = valid[0], valid[1].event.decided_at
        # Heartbeats outlive a failed publish (a NATS outage): the loop is started again.
        beats = asyncio.create_task(
            keep_running(lambda: self._heartbeats(stop), name="heartbeats", stop=stop), name="heartbeats"
        )
        self._refill_spares()
        try:
            self.dirty.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.dirty.wait(), 0.5)
                if self.dirty.is_set():
                    self.dirty.clear()
                    await self.reconcile()
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)
            await asyncio.gather(
                *(s.stop() for s in self.sidecars.values()),
                *self._stopping,
                self._stop_spares(),
                return_exceptions=True,
            )
            self.sidecars.clear()
            await self.projection.stop()

"""The whole emulated stack in one event loop: admission, allocator, placer, node daemons
and, optionally, the profiler.

Used by the emulate-vs-simulate conformance test and the service benchmark. Node
daemons still run every sidecar as a real subprocess; the services themselves are
asyncio tasks here (``shoal up``, and ``shoal demo`` on top of it, run each as its own
supervised process instead).
All parts share one :class:`~shoal.clock.ScaledClock`, so the log is stamped in
virtual seconds, like the simulator's.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

import msgspec
from msgspec import Struct
from shoal import admission
from shoal.bus import Bus
from shoal.clock import HOLD_TTL_S, ScaledClock, SharedClock, hold, release, submit_key
from shoal.events import JobSpec
from shoal.gpus import fake_gpus
from shoal.models import Catalog, get_catalog
from shoal.policies.base import Policy
from shoal.profiling import ProfileParams
from shoal.profiling.ratelimit import MIN_INTERVAL_S
from shoal.projection import Projection
from shoal.sim.metrics import jct_summary
from shoal.state import COMPLETED, FINISHED_STATUSES, ClusterState
from shoal.workloads import TraceJob
from shoal_services.admission.service import AdmissionService
from shoal_services.allocator.service import AllocatorService
from shoal_services.node_daemon.service import NodeDaemon
from shoal_services.placer.service import PlacerService
from shoal_services.profiler.service import ProfilerService

STALL_S = 60.0
"""Wall seconds virtual time may stand still during a replay before it is an error
(a synchronized clock held by a barrier nobody will release)."""


class StackConfig(Struct, frozen=True, kw_only=True):
    nodes: int = 4
    gpus_per_node: int = 4
    gpu_type: str = "V100"
    time_scale: float = 1000.0
    costs: str = "coddl"
    catalog: str = "afs"
    placer: str = "min-migration"
    network_packing: bool = True
    heartbeat_s: float = 1.0
    report_every_s: float = 0.25
    spares: int = 1
    """Spare sidecars each node daemon keeps started (see the node daemon)."""
    synchronized: bool = False
    """Share a :class:`~shoal.clock.SharedClock` that stands still while the control
    plane works on an event (exact emulation at any time scale; see its docstring)
    instead of a free-running :class:`~shoal.clock.ScaledClock`."""
    hold_ttl_s: float = HOLD_TTL_S
    """With ``synchronized``: how long a hand-over hold nobody releases lives (wall
    seconds, :meth:`shoal.clock.SharedClock.create`)."""
    profiler: bool = False
    """Also run the profiler (:class:`~shoal_services.profiler.service.ProfilerService`),
    which turns the trainers' progress reports into throughput models."""
    profiler_min_interval_s: float = MIN_INTERVAL_S
    """The profiler's ``min_interval_s`` (virtual seconds)."""
    profiler_params: ProfileParams | None = None
    """The profiler's modelling parameters (None: :class:`~shoal.profiling.ProfileParams`)."""
    allocator_catalog: bool = True
    """Give the allocator ``catalog``. False: a job without a profile is unknown to it and
    starts on AFS §4.5's estimate, while the emulated trainers still run at their catalog
    curve (their truth)."""


class EmulatedStack:
    """Start and stop every service of one installation on emulated GPUs."""

    def __init__(
        self,
        bus: Bus,
        nats_url: str,
        policy: Policy,
        config: StackConfig | None = None,
        *,
        creds: str | None = None,
    ) -> None:
        self.bus = bus
        self.creds = creds
        """The seed file the sidecars authenticate with (:mod:`shoal.auth`); None: theirs
        come from the environment."""
        self.nats_url = nats_url
        self.policy = policy
        self.config = config or StackConfig()
        self._clock_dir: tempfile.TemporaryDirectory[str] | None = None
        self.clock: ScaledClock | SharedClock
        if self.config.synchronized:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # no disk writes per hold
            self._clock_dir = tempfile.TemporaryDirectory(prefix="shoal-clock-", dir=shm)
            self.clock = SharedClock.create(
                os.path.join(self._clock_dir.name, "clock"),
                self.config.time_scale,
                hold_ttl_s=self.config.hold_ttl_s,
            )
        else:
            self.clock = ScaledClock(self.config.time_scale)
        self.catalog: Catalog | None = get_catalog(self.config.catalog) if self.config.catalog else None
        self.stop_event = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.daemons: list[NodeDaemon] = []
        self.projection = Projection(bus)
        self.admission: AdmissionService | None = None
        self.allocator: AllocatorService | None = None
        self.profiler: ProfilerService | None = None

    def _sidecar_argv(self, node_id: str) -> Callable[[str], Sequence[str]]:
        c = self.config

        def argv(job_id: str) -> list[str]:
            return [
                sys.executable,
                "-m",
                "shoal_services.trainer_sidecar",
                "--job",
                job_id,
                "--node",
                node_id,
                "--nats-url",
                self.nats_url,
                "--prefix",
                self.bus.names.prefix,
                *(["--creds", self.creds] if self.creds else []),
                "--time-scale",
                repr(self.clock.scale),
                "--clock-origin",
                repr(self.clock.origin),
                *(["--clock-file", self.clock.path] if isinstance(self.clock, SharedClock) else []),
                "--costs",
                c.costs,
                "--catalog",
                c.catalog,
                "--report-every",
                repr(c.report_every_s),
            ]

        return argv

    async def start(self) -> None:
        c = self.config
        stop = self.stop_event
        # The placer and the node daemons share the stack's projection (one decode of
        # each event instead of one per service); they attach before it starts.
        placer = PlacerService(
            self.bus, holder="stack-placer", clock=self.clock, placer=c.placer, projection=self.projection
        )
        for i in range(c.nodes):
            node_id = f"node{i}"
            self.daemons.append(
                NodeDaemon(
                    self.bus,
                    node_id,
                    fake_gpus(c.gpus_per_node, c.gpu_type),
                    clock=self.clock,
                    sidecar_argv=self._sidecar_argv(node_id),
                    heartbeat_s=c.heartbeat_s,
                    hostname=node_id,
                    spares=c.spares,
                    projection=self.projection,
                )
            )
        await self.projection.start()
        await self.projection.wait_ready()
        self.admission = AdmissionService(
            self.bus, self.projection, admission.Limits(), clock=self.clock, accept_submitted_at=True
        )
        await self.admission.start()
        allocator = AllocatorService(
            self.bus,
            self.policy,
            holder="stack-allocator",
            clock=self.clock,
            catalog=self.catalog if c.allocator_catalog else None,
            network_packing=c.network_packing,
            node_timeout_s=max(10.0, 5 * c.heartbeat_s),
            heartbeat_s=c.heartbeat_s,
        )
        self.allocator = allocator
        self.tasks += [asyncio.create_task(allocator.run(stop)), asyncio.create_task(placer.run(stop))]
        if c.profiler:
            self.profiler = ProfilerService(
                self.bus,
                holder="stack-profiler",
                clock=self.clock,
                params=c.profiler_params,
                min_interval_s=c.profiler_min_interval_s,
            )
            self.tasks.append(asyncio.create_task(self.profiler.run(stop)))
        self.tasks += [asyncio.create_task(daemon.run(stop)) for daemon in self.daemons]
        await self.wait(lambda s: len(s.nodes) >= c.nodes, timeout_s=30)
        # Jobs placed before the spares are up would pay a sidecar's cold start.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while any(d.spares_ready() < c.spares for d in self.daemons) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        # A trace replayed before the allocator leads would see its first arrivals
        # decided together at the takeover instant instead of at their own.
        await self.wait(lambda s: allocator.is_leader and allocator.asof is not None, timeout_s=30)
        if self.profiler is not None:
            profiler = self.profiler
            await self.wait(lambda s: profiler.is_leader, timeout_s=30)

    def check_services(self) -> None:
        """Raise if a service of the stack has failed.

        Raises:
            RuntimeError: from the service's exception.
        """
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception():
                raise RuntimeError("a service of the emulated stack failed") from t.exception()

    async def wait(self, predicate: Callable[[ClusterState], bool], timeout_s: float) -> None:
        """Wait until ``predicate(state)`` holds on the stack's folded state."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self.projection.state):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the emulated stack did not reach the expected state in time")
            self.check_services()
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.stop_event.set()
        if self.admission is not None:
            await self.admission.stop()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.projection.stop()
        if self._clock_dir is not None:
            self._clock_dir.cleanup()


async def replay_trace(
    stack: EmulatedStack,
    jobs: Sequence[TraceJob],
    *,
    on_tick: Callable[[ClusterState, float], None] | None = None,
    tick_s: float = 0.5,
    attach_profiles: bool = True,
) -> None:
    """Submit each job at its trace time (virtual, from the stack's clock origin) and
    wait until all are finished. Submissions go through the admission service."""
    from shoal import events as ev
    from shoal.client import Client

    client = Client(stack.bus)
    # A whole virtual second, so that arrivals, completions (rounded up to whole
    # seconds) and periodic decisions fall on the same grid as in the simulator. A
    # synchronized clock is stopped first and then held there: at 1000x the next whole
    # second is under 1 ms of wall time away, and a hold placed at it while time runs
    # lands after it when the host is slow (tests/services/test_allocator_placer.py).
    if isinstance(stack.clock, SharedClock):
        stack.clock.hold("arrival", ttl_s=None)
        origin = float(math.ceil(stack.clock.barriers()["arrival"]))
    else:
        origin = float(math.ceil(stack.clock.now()))
    pending = sorted(jobs, key=lambda j: (j.submit_time_s, j.job_id))
    t0 = pending[0].submit_time_s if pending else 0.0
    if stack.allocator is not None:
        # Periodic decisions on the trace's own grid, as in the simulator.
        stack.allocator.tick_origin = origin - t0
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    ids = {j.job_id for j in jobs}
    # A synchronized clock does not pass the next arrival before it is submitted.
    if pending:
        hold(stack.clock, "arrival", origin + pending[0].submit_time_s - t0, ttl_s=None)
    else:
        release(stack.clock, "arrival")
    stood_at, stood_since = -math.inf, loop.time()
    while True:
        now = stack.clock.now()
        stack.check_services()
        if now > stood_at:
            stood_at, stood_since = now, loop.time()
        elif loop.time() - stood_since > STALL_S:
            held = stack.clock.barriers() if isinstance(stack.clock, SharedClock) else {}
            raise TimeoutError(
                f"virtual time has stood still at {now} for {STALL_S:.0f} wall seconds; held by {held}"
            )
        due: list[ev.SubmitJob] = []
        while pending and origin + pending[0].submit_time_s - t0 <= now:
            job = pending.pop(0)
            # Recorded at its trace instant, not when this loop got to it; the job's
            # calibrated curve travels with it (the simulator publishes it on arrival),
            # so the arrival decision already uses it.
            spec = with_profile(job) if attach_profiles else job.spec
            due.append(
                ev.SubmitJob(spec=spec, job_id=job.job_id, submitted_at=origin + job.submit_time_s - t0)
            )
        if due:
            # Each arrival holds a synchronized clock until the allocator has decided on it.
            keys = [submit_key(cmd.job_id or "") for cmd in due]
            for key in keys:
                hold(stack.clock, key)
            if pending:
                hold(stack.clock, "arrival", origin + pending[0].submit_time_s - t0, ttl_s=None)
            else:
                release(stack.clock, "arrival")
            # Everything due is submitted at once, so a same-instant burst lands together.
            try:
                await asyncio.gather(*(client.command(cmd) for cmd in due))
            except BaseException:
                release(stack.clock, *keys)
                raise
        state = stack.projection.state
        if on_tick is not None and loop.time() >= next_tick:
            on_tick(state, now - origin)
            next_tick = loop.time() + tick_s
        if not pending and all(j in state.jobs and state.jobs[j].status in FINISHED_STATUSES for j in ids):
            # The allocator's decision on the last completion (freeing its GPUs) is
            # part of the run, as in the simulator's log.
            deadline = loop.time() + 2.0
            while stack.projection.state.shares and loop.time() < deadline:
                await asyncio.sleep(0.01)
            return
        wait = stack.clock.to_wall(origin + pending[0].submit_time_s - t0 - now) if pending else 0.05
        await asyncio.sleep(min(max(wait, 0.0), 0.05))


def with_profile(job: TraceJob) -> JobSpec:
    """The job's spec carrying its calibrated curves as a known profile."""
    profile = {"": {k: v for k, v in enumerate(job.throughput) if k > 0}}
    for gpu_type, curve in sorted(job.throughput_by_type.items()):
        profile[gpu_type] = {k: v for k, v in enumerate(curve) if k > 0}
    return msgspec.structs.replace(job.spec, profile=profile)


def summarize(state: ClusterState, job_ids: Sequence[str], total_gpus: int) -> dict[str, float]:
    """JCT statistics, makespan and GPU utilisation of the given jobs, from the folded log."""
    jobs = [state.jobs[j] for j in job_ids if j in state.jobs]
    done = [j for j in jobs if j.status == COMPLETED and j.finished_at is not None]
    jcts = [j.finished_at - j.submitted_at for j in done]  # type: ignore[operator]
    start = min((j.submitted_at for j in jobs), default=0.0)
    end = max((j.finished_at or start for j in jobs), default=start)
    makespan = max(0.0, end - start)
    gpu_s = sum(j.attained_service_gpu_s for j in jobs)
    out = {
        **jct_summary(jcts),
        "makespan_s": makespan,
        "completed": float(len(done)),
        "jobs": float(len(jobs)),
        "gpu_utilisation": gpu_s / (total_gpus * makespan) if makespan > 0 and total_gpus else math.nan,
        "reconfigurations": float(sum(j.reconfigurations for j in jobs)),
    }
    return out

"""Discrete-event simulation of a shared GPU cluster in virtual time.

The simulator drives the same code the services run: every state change is an event
appended to an :class:`~shoal.sim.log.InMemoryLog` and folded by
:func:`shoal.state.apply`; decisions come from the views of :mod:`shoal.view` (the
same as ``build_view``, memoised per waiting job) and
:mod:`shoal.allocation`. Only the passage of time and the jobs' progress are modelled
here, in place of the trainer sidecars.

Event sequence (REPRODUCTION.md, "AFS / CoDDL"):

* Users of ``SimConfig.users`` (``UserRegistered``) and nodes (``NodeRegistered``) are
  registered at t = 0: one node of ``total_gpus`` in the flat pool (``flat=True``; no
  network packing, no placement), else ``total_gpus / gpus_per_node`` servers.
* Arrival: ``JobSubmitted`` and, with ``profiling="oracle"``, the job's curve as a
  ``ThroughputModelUpdated`` (``model_kind="table"``; one more per GPU generation on a
  heterogeneous cluster). Arrivals are whole seconds (rounded up by the loader).
* Decision at every arrival, completion, model update and policy tick, after all events
  of that virtual second (coalesced): ``ProgressReported`` for each running job whose
  GPUs change (settles its continuous progress), ``SharesDecided`` (skipped when shares
  and memory are unchanged, as the allocator skips it), ``PlacementDecided`` (when
  placing, and the placement changed; the placer is not asked when no new decision was
  published, or when the shares equal what every job holds and the placer is
  min-migration, which then keeps every GPU), and one ``ReconfigurationCompleted`` per
  changed job at ``now + stop_time``. Every change is charged by
  :func:`shoal.sim.costs.charge` (kinds start, stop, scale-out, scale-in, migrate, and
  restart for a move to GPUs disjoint from the job's, as ``train/controller.py`` runs
  it): ``stop_time`` is its equivalent stop (a scale-out's prepare phase on the old rate
  folded in) and its lost GPU time is added to ``lost_gpu_s`` (the new workers' prepare
  phase included). The stop is timed from the decision: a scale-out's
  ``ReconfigurationCompleted`` comes at the equivalent stop's end, not at the switch.
* A newer change before a job's stop ends cancels the in-flight one (CoDDL §4.3):
  ``ReconfigurationCancelled(epoch, by_epoch)``, the old epoch never completes, the
  new change's stop starts at once, and the unelapsed part of the cancelled change's
  (equivalent) stop times its GPUs is taken back from the lost GPU time; the rest of a
  cancelled scale-out's prepare charge stays counted.
* Completion: at ``ceil(exact finish time)`` (whole seconds, a 1 µs tolerance absorbs
  float error), ``JobCompleted``.
* Progress is continuous: ``rate = curve[gpus]`` iterations/s from
  ``max(change time, end of the stop)`` on; a job makes no progress while stopped.
* Metrics (:mod:`shoal.sim.metrics`) are sampled after every decision from running
  sums kept as jobs change (:meth:`Simulator.recompute_metrics` is the from-scratch
  version the tests compare against).

Policy ticks (lease/quantum timeouts): the policy's ``tick_s`` attribute (or
``lease_s``/``quantum_s``), overridable by ``SimConfig.tick_s``, re-runs the policy on the
grid ``k·tick_s`` while jobs are active; in addition a decision whose memory holds
``next_decision_at_s`` asks for a re-run then (rounded up to a whole second).

Heterogeneous clusters (Gavel, Gandiva_fair §3.4): ``SimConfig.cluster`` maps GPU
generation -> count (``parse_cluster("64xk80,24xp100,12xv100")``). Each generation gets
its own nodes (``<type>-n<i>``; in the flat setting one pool node per generation), so
``view.gpus_by_type`` lists the inventory and the placer keeps a job on the generation
the policy chose (``Decision.gpu_types`` -> ``SharesDecided`` -> ``PlacementDecided``).
A policy that names no type is placed anywhere. Progress uses the curve of the
generation the job actually runs on; a gang spread over several generations runs at
the slowest one's rate at its GPU count (synchronous steps wait for the slowest
worker; choice). A generation the job has no curve for uses the job's default curve.
The job's per-generation curves are published at arrival as one
``ThroughputModelUpdated`` per generation of the cluster (matched case-insensitively
to the workload's curve names).

Users and tickets (Gandiva_fair §3.1): ``SimConfig.users`` (user -> tickets) is
registered at t = 0 with ``UserRegistered``; jobs name their user in ``JobSpec.user``.
A policy that trades GPUs between users (Gandiva_fair) reports its trades in
``Decision.memory["trades_executed"]``/``["trades_undone"]``; the simulator publishes
them as ``TradeExecuted``/``TradeUndone`` after the ``SharesDecided`` that carries
them (they do not trigger another decision: that decision already holds them).

Throughput measurement (``SimConfig.profiling``):

* ``oracle`` (default): the true curve is published at arrival (the AFS simulator's
  setting for AFS-P and Optimus, §5.1).
* ``overestimate`` (CoDDL §4.5, "overestimate first and re-adjust later"): the true
  curve is hidden. At arrival nothing is published (the profiler knows nothing), so
  the view assumes linear scaling (:func:`shoal.view.job_curve`'s fallback, equal to
  ``estimate_curve({})``). Decisions go through
  :func:`shoal.profiling.overestimate.decide_overestimate_first` with
  :func:`shoal.view.estimated_jobs` of the folded state, as in the allocator service:
  a new job's first share is capped at the fair share 1/n, and a job measured at its
  share is taken through the unmeasured allocatable units below it, largest first
  (``probe_shares``), before the policy re-adjusts it. When the job has run ``measure_s`` seconds on
  k GPUs of one generation (counted from the end of its reconfiguration stop;
  default the profiler's ``min_interval_s``, the least time between two of its models
  of a job), the simulator "measures" the true throughput at k only and publishes
  :func:`~shoal.profiling.overestimate.estimate_curve` of all measurements so far as a
  ``ThroughputModelUpdated`` (``model_kind="afs-overestimate"``, ``measured`` = the
  measured counts, ``overestimated`` while some count up to ``max_gpus`` is
  unmeasured), as the profiler does. That event triggers a decision
  (``model_update``), as it does for the allocator service: the next probe unit, or
  the re-adjustment on the measured curve. Each probed unit therefore costs
  ``measure_s`` at that unit's throughput (GPUs above it idle) plus the cost model's
  stop time of the shrink, like any other change. Oracle mode publishes every curve at
  arrival, so no job is on the estimate and the plain ``decide_shares`` runs.

Open points, chosen: a job with a positive share the placer could not place runs on
nothing at that epoch (counted in ``unplaced_decisions``); when jobs are active but no
job runs and no future event exists, the run stops with :class:`SimulationStalled`
rather than loop forever.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from msgspec import Struct

from shoal import events as ev
from shoal.allocation import decide_shares, place
from shoal.events import GpuInfo
from shoal.placement.hinted import NODE_HINTS
from shoal.policies.base import (
    ClusterView,
    JobView,
    LiveJobs,
    Policy,
    policy_reads_progress,
    prime_jobs_by_id,
)
from shoal.profiling.overestimate import decide_overestimate_first
from shoal.profiling.ratelimit import MIN_INTERVAL_S
from shoal.sim.costs import PRESETS, ReconfigCosts, charge, classify, measured
from shoal.sim.log import InMemoryLog, VirtualClock
from shoal.sim.metrics import Series, UserShares, jct_summary
from shoal.state import digest
from shoal.view import cluster_gpus, estimated_jobs, job_curve, job_view, views_at
from shoal.workloads import TraceJob

_EPS = 1e-6

_VIEW_NEUTRAL = (
    ev.PlacementDecided,
    ev.NodeRegistered,
    ev.UserRegistered,
    ev.TicketsSet,
    ev.TradeExecuted,
    ev.TradeUndone,
)
"""Events without a ``job_id`` that change nothing a job's view reads."""

_CLUSTER_NEUTRAL = (ev.SharesDecided, ev.PlacementDecided)
"""Events without a ``job_id`` that change neither nodes, GPUs nor users (the fold of
these two touches only jobs, shares and placements)."""

_VIEW_SERIALS = itertools.count(1)
"""Serials of the simulators' views (:attr:`shoal.policies.base.LiveJobs.serial`), one
counter for every simulator in the process, so that no two views share one."""

PROFILING_MODES: tuple[str, ...] = ("oracle", "overestimate")


def parse_cluster(text: str) -> dict[str, int]:
    """A GPU inventory from ``"64xk80,24xp100"`` (or ``"k80=64,p100=24"``).

    Returns:
        GPU type -> count, in the order given.

    Raises:
        ValueError: malformed entry, non-positive count or a type given twice.
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part:
            gpu_type, _, count = part.partition("=")
        else:
            count, sep, gpu_type = part.partition("x")
            if not sep:
                raise ValueError(f"cluster entry {part!r} is not <count>x<type> (e.g. 64xk80)")
        gpu_type, count = gpu_type.strip(), count.strip()
        if not count.isdigit() or int(count) <= 0:
            raise ValueError(f"cluster entry {part!r}: the count must be a positive integer")
        if not gpu_type or any(not (c.isalnum() or c in "_.-") for c in gpu_type):
            raise ValueError(f"cluster entry {part!r}: bad GPU type {gpu_type!r}")
        if gpu_type in out:
            raise ValueError(f"GPU type {gpu_type!r} given twice in {text!r}")
        out[gpu_type] = int(count)
    if not out:
        raise ValueError(f"empty cluster spec {text!r}")
    return out


def _node_token(gpu_type: str) -> str:
    return gpu_type.replace(".", "_")


class SimulationStalled(RuntimeError):
    """Active jobs remain but nothing runs and nothing will happen."""


class SimConfig(Struct, frozen=True, kw_only=True):
    """How the simulated cluster and run are set up."""

    total_gpus: int = 64
    gpus_per_node: int = 4
    flat: bool = False
    """A flat pool: no servers, no network packing, no placement (the AFS simulator)."""
    gpu_type: str = "gpu"
    network_packing: bool = True
    """Regulate shares to server sizes (AFS appendix E); ignored when ``flat``."""
    placer: str = "min-migration"
    costs: ReconfigCosts | None = None
    """``None``: ``free`` when flat, ``measured`` (shoal's trainer, :func:`shoal.sim.costs.measured`) on a topology."""
    tick_s: float | None = None
    """Policy re-run period; ``None``: the policy's own ``tick_s``/``lease_s``/``quantum_s``."""
    # Keep every event's envelope in ``log.envelopes`` (to replay or inspect the log);
    # False folds and counts each event without making one (the same results).
    retain_log: bool = True
    max_time_s: float | None = None
    """Stop at this virtual time (unfinished jobs are reported, not counted in JCT)."""
    series: bool = True
    cluster: dict[str, int] | None = None
    """Heterogeneous inventory, GPU type -> count (see :func:`parse_cluster`); when set it
    replaces ``total_gpus`` and ``gpu_type``. Each count must split into nodes."""
    users: dict[str, int] = {}
    """Users registered at t = 0 with their tickets (Gandiva_fair); others get the fold's default."""
    profiling: str = "oracle"
    """``oracle`` or ``overestimate`` (CoDDL §4.5); see the module docstring."""
    measure_s: float = MIN_INTERVAL_S
    """Seconds a job runs on a GPU count before its measurement there is published
    (``overestimate``); default: the profiler's least interval between two models of a
    job (:data:`shoal.profiling.ratelimit.MIN_INTERVAL_S`, the live profiler's
    ``profiler_min_interval_s``)."""

    def inventory(self) -> dict[str, int]:
        """GPU type -> count of the simulated cluster."""
        return dict(self.cluster) if self.cluster else {self.gpu_type: self.total_gpus}

    def gpus(self) -> int:
        """Total GPUs of the simulated cluster."""
        return sum(self.inventory().values())


class JobOutcome(Struct, frozen=True, kw_only=True):
    job_id: str
    model: str
    requested_gpus: int
    arrival_s: float
    completion_s: float | None
    jct_s: float | None
    duration_s: float
    """Trace run time at the request (what the job would take alone)."""
    wait_s: float
    """Time without GPUs."""
    reconfigurations: int
    user: str = ""


class SimResult(Struct, kw_only=True):
    """What a run produced."""

    policy: str
    trace: str
    config: SimConfig
    summary: dict[str, float]
    jobs: list[JobOutcome]
    series: Series
    event_counts: dict[str, int]
    final_digest: str = ""
    user_shares: UserShares | None = None
    """GPUs held per user per generation over time (``None`` when ``series`` is off)."""


class _Job:
    """The simulator's mutable record of one job (progress lives here, not in the state)."""

    __slots__ = (
        "arrival",
        "by_type",
        "curve",
        "done",
        "duration",
        "finished_at",
        "gpus",
        "id",
        "model",
        "pend_c",
        "pend_inv",
        "pending_since",
        "rate",
        "reconfigs",
        "requested",
        "resume_at",
        "seq",
        "settled_at",
        "total",
        "types",
        "user",
        "version",
        "wait",
    )

    def __init__(self, tj: TraceJob, by_type: dict[str, tuple[float, ...]]) -> None:
        self.id = tj.job_id
        self.arrival = tj.submit_time_s
        self.curve = tj.throughput
        self.by_type = by_type
        """True curve per generation of the cluster (absent: ``curve``)."""
        self.types: dict[str, int] = {}
        """GPUs held per generation."""
        self.user = tj.spec.user
        self.total = float(tj.spec.total_iterations or 0)
        self.duration = tj.duration_s
        self.model = tj.spec.model
        self.requested = tj.spec.requested_gpus
        self.done = 0.0
        self.settled_at = tj.submit_time_s
        self.rate = 0.0
        self.resume_at = 0.0
        self.gpus = 0
        self.version = 0
        self.wait = 0.0
        self.pending_since: float | None = tj.submit_time_s
        self.pend_inv = 0.0
        """1 / remaining time on 1 GPU while pending (BI's weight), else 0."""
        self.pend_c = 0.0
        """(wait - pending_since) · pend_inv while pending: BI_j(t) = pend_c + t · pend_inv."""
        self.finished_at: float | None = None
        self.reconfigs = 0
        self.seq = 0
        """Arrival index: the engine's active-job order (``Simulator.active``)."""

    def progress(self, now: float) -> float:
        if self.rate <= 0.0:
            return self.done
        start = self.settled_at if self.settled_at > self.resume_at else self.resume_at
        if now <= start:
            return self.done
        return min(self.total, self.done + self.rate * (now - start))


def _seq(job: _Job) -> int:
    return job.seq


def _fit(curve: Sequence[float], width: int) -> tuple[float, ...]:
    """``curve`` cut or extended (last value repeated: no further speedup) to ``width`` points."""
    out = tuple(float(v) for v in curve[:width])
    if len(out) < width:
        out += (out[-1] if out else 0.0,) * (width - len(out))
    return out


def policy_tick(policy: Policy) -> float | None:
    """The policy's re-run period, if it declares one."""
    for attr in ("tick_s", "lease_s", "quantum_s"):
        value = getattr(policy, attr, None)
        if isinstance(value, int | float) and value > 0:
            return float(value)
    return None


class Simulator:
    """One simulation run: a workload, a policy and a cluster.

    Args:
        jobs: the workload, in submission order.
        policy: the allocation policy.
        config: cluster and run settings.
        trace: name of the workload (for the result).
        on_progress: called as ``on_progress(completed, total, now)`` now and then.
    """

    def __init__(
        self,
        jobs: Sequence[TraceJob],
        policy: Policy,
        config: SimConfig | None = None,
        *,
        trace: str = "",
        on_progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.config = config or SimConfig()
        cfg = self.config
        self.inventory = cfg.inventory()
        self.total_gpus = sum(self.inventory.values())
        if self.total_gpus <= 0 or any(n <= 0 for n in self.inventory.values()):
            raise ValueError("every GPU count must be positive")
        if not cfg.flat:
            for gpu_type, count in self.inventory.items():
                if cfg.gpus_per_node <= 0 or count % cfg.gpus_per_node:
                    raise ValueError(
                        f"{count} {gpu_type} GPUs do not split into nodes of {cfg.gpus_per_node}"
                    )
        if cfg.profiling not in PROFILING_MODES:
            raise ValueError(f"profiling is one of {', '.join(PROFILING_MODES)}; got {cfg.profiling!r}")
        self.policy = policy
        self.trace = trace
        self.on_progress = on_progress
        # One cost model: a policy that plans with reconfiguration costs (SideCar) plans
        # with the ones charged here; costs it names itself are used when the config
        # names none, and refused when it names others.
        planned = getattr(policy, "planning_costs", None)
        own = planned() if callable(planned) else None
        if cfg.costs is not None and own is not None and own != cfg.costs:
            raise ValueError(
                f"the policy plans with {own.name!r} costs but the config charges {cfg.costs.name!r}"
            )
        self.costs = cfg.costs or own or (PRESETS["free"] if cfg.flat else measured())
        bind = getattr(policy, "bind_costs", None)
        if callable(bind):
            bind(self.costs)
        self.tick = cfg.tick_s if cfg.tick_s is not None else policy_tick(policy)
        self.trace_jobs = sorted(jobs, key=lambda j: j.submit_time_s)
        ids = [j.job_id for j in self.trace_jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate job ids in workload")
        self.hetero = len(self.inventory) > 1
        self.default_type = next(iter(self.inventory))
        # The flat homogeneous pool needs no placement (the AFS simulator); every other
        # setting places, so generations are respected.
        self.placing = not cfg.flat or self.hetero
        self._carry_progress = policy_reads_progress(policy)
        """Whether a running job's view is carried to each decision's instant (see
        :func:`shoal.policies.base.policy_reads_progress`)."""
        self.clock = VirtualClock(0.0)
        self.log = InMemoryLog(retain=cfg.retain_log)
        self.jobs: dict[str, _Job] = {}
        self.active: dict[str, _Job] = {}
        """Active jobs in arrival order (dicts keep insertion order)."""
        self.curves: dict[str, tuple[float, ...]] = {}
        """Published (what the policy may know) default curve per job."""
        self.curves_by_type: dict[str, dict[str, tuple[float, ...]]] = {}
        """Published per-generation curves per job (heterogeneous clusters)."""
        self.series = Series()
        self.user_shares = UserShares()
        self._finish_heap: list[tuple[float, int, str, int]] = []
        self._reconf_heap: list[tuple[float, int, str, int, int, float]] = []
        self._pending_reconf: dict[str, int] = {}
        self._measure_heap: list[tuple[float, int, str, int]] = []
        self._measured: dict[str, dict[str, dict[int, float]]] = {}
        """overestimate mode: job -> generation -> measured GPU count -> true throughput."""
        self._heap_seq = 0
        self._wakeup: float | None = None
        self._topology: Any = None
        self._node_type: dict[str, str] = {}
        self._placer_keeps_same = cfg.placer == "min-migration"
        self._views: dict[str, JobView | None] = {}
        """Every active job's view, in arrival order; a job's entry is rebuilt when it is in
        ``_stale`` or holds GPUs, and otherwise stays until an event about it (see _emit)."""
        # Whether _views (in arrival-event order) is in arrival order, (arrival_s, job_id):
        # jobs arrive in time order, so only a tie in the same second out of id order breaks it.
        self._arrival_ordered = True
        self._last_arrival: tuple[float, str] | None = None
        self._stale: set[str] = set()
        self._live_jobs: LiveJobs | None = None
        """The jobs of the newest view, over ``_views`` (expired before _views changes)."""
        self._view_serial = 0
        """The serial of the newest view's jobs (LiveJobs.serial); 0 before the first."""
        self._left: list[str] = []
        """The jobs removed from ``_views`` since the newest view (LiveJobs.left_since)."""
        self._cluster: tuple[dict[str, int], dict[str, float]] | None = None
        """GPUs by generation (:func:`shoal.view.cluster_gpus`) and users' tickets of the
        state, kept until an event that can change them is folded (see _emit)."""
        self._running: dict[str, _Job] = {}
        """Jobs that hold GPUs (``job.gpus > 0``); few next to a long queue."""
        self._alloc: dict[str, int] = {}
        """``job.gpus`` of every job in ``_running`` (kept with it): the shares in force,
        compared with a decision's in C (``dict`` equality and item-set differences)."""
        self._typed = False
        """Whether any ``SharesDecided`` emitted so far named a GPU type; until one does,
        every job's folded ``gpu_type`` is empty (only that event's fold sets it)."""
        self._arrived = 0
        self.reconfigurations = 0
        self.starts = 0
        self.preemptions = 0
        self.lost_gpu_s = 0.0
        self.gpu_s_used = 0.0
        self.unplaced_decisions = 0
        self.migrations = 0
        self.decisions = 0
        self.model_updates = 0
        self._used = 0
        self._used_since = 0.0
        # Running sums behind QL, CE, BI and the per-user shares (see _sample).
        self._n_pending = 0
        self._bi_s1 = 0.0
        self._bi_s2 = 0.0
        self._n_running = 0
        self._ce_sum = 0.0
        self._held: dict[tuple[str, str], int] = {}

    # -- emission --------------------------------------------------------------

    def _emit(self, event: ev.Event, at: float | None = None) -> None:
        # A kept view stays right while no event about its job is folded: what job_view
        # reads of a job without GPUs (spec, progress, service, curves, convergence)
        # changes only with such an event, and its exact progress only when it gets a
        # share (SharesDecided names it). A running job's view only moves in time (see
        # _view) until then.
        job_id = getattr(event, "job_id", None)
        if job_id is not None:
            self._stale.add(job_id)
        elif isinstance(event, ev.SharesDecided):
            # The fold touches only the jobs whose share or GPU type changes: the shares'
            # changes are the item sets' difference (a job in both keeps its share), and
            # GPU types are compared only once some decision named one (see _typed).
            state = self.log.state
            old, new, types = state.shares, event.shares, event.gpu_types
            stale = self._stale
            stale.update(j for j, _ in old.items() ^ new.items())
            if types:
                self._typed = True
            if self._typed:
                for j in old.keys() | new.keys():
                    js = state.jobs.get(j)
                    if js is None or js.gpu_type != types.get(j, ""):
                        stale.add(j)
        elif not isinstance(event, _VIEW_NEUTRAL):
            self._stale.update(self._views)
        if job_id is None and not isinstance(event, _CLUSTER_NEUTRAL):
            # A node, GPU, user or ticket event: the inventory and tickets are read again.
            self._cluster = None
        self.log.append(event, self.clock.now if at is None else at)

    # -- setup -----------------------------------------------------------------

    def _register_nodes(self) -> None:
        cfg = self.config
        for user, tickets in sorted(cfg.users.items()):
            self._emit(ev.UserRegistered(user=user, tickets=tickets), at=0.0)
        nodes: list[tuple[str, int, str]] = []
        if cfg.flat:
            if self.hetero:
                nodes = [(f"pool-{_node_token(t)}", n, t) for t, n in self.inventory.items()]
            else:
                nodes = [("pool", self.total_gpus, self.default_type)]
        else:
            for gpu_type, count in self.inventory.items():
                prefix = f"{_node_token(gpu_type)}-n" if self.hetero else "n"
                nodes.extend(
                    (f"{prefix}{i}", cfg.gpus_per_node, gpu_type) for i in range(count // cfg.gpus_per_node)
                )
        if self.placing:
            from shoal.placement import NodeSlots, Topology

            self._topology = Topology(
                nodes=tuple(
                    NodeSlots(node_id=node_id, gpu_indices=tuple(range(count)), gpu_type=gpu_type)
                    for node_id, count, gpu_type in nodes
                )
            )
        for node_id, count, gpu_type in nodes:
            self._node_type[node_id] = gpu_type
            gpus = tuple(GpuInfo(index=i, gpu_type=gpu_type) for i in range(count))
            self._emit(ev.NodeRegistered(node_id=node_id, gpus=gpus, emulated=True), at=0.0)

    # -- the loop ----------------------------------------------------------------

    def run(self) -> SimResult:
        """Simulate to the last completion (or ``max_time_s``)."""
        self._register_nodes()
        arrivals = self.trace_jobs
        n_total = len(arrivals)
        nxt = 0
        completed = 0
        idle_decisions = 0
        report_every = max(1, n_total // 200)
        limit = self.config.max_time_s
        while nxt < n_total or self.active:
            t_next = math.inf
            if nxt < n_total:
                t_next = arrivals[nxt].submit_time_s
            t_finish = self._peek_finish()
            if t_finish is not None:
                t_next = min(t_next, t_finish)
            t_measure = self._peek_measure() if self._measure_heap else None
            if t_measure is not None:
                t_next = min(t_next, t_measure)
            t_event = t_next
            if self.active:
                if self.tick:
                    t_next = min(t_next, (math.floor(self.clock.now / self.tick + _EPS) + 1) * self.tick)
                if self._wakeup is not None and self._wakeup > self.clock.now:
                    t_next = min(t_next, self._wakeup)
            if math.isinf(t_next):
                raise SimulationStalled(
                    f"at t={self.clock.now:.0f}s {len(self.active)} jobs are active but none runs "
                    f"and no event is due (e.g. {next(iter(self.active))})"
                )
            if limit is not None and t_next > limit:
                break
            self._flush_reconf(t_next)
            self._advance(t_next)
            now = t_next
            trigger = "tick"
            # Completions first: their GPUs are free for this second's decision.
            while (t := self._peek_finish()) is not None and t <= now:
                _, _, job_id, _ = heapq.heappop(self._finish_heap)
                self._complete(self.jobs[job_id], now)
                completed += 1
                trigger = "completion"
                if self.on_progress is not None and completed % report_every == 0:
                    self.on_progress(completed, n_total, now)
            while nxt < n_total and arrivals[nxt].submit_time_s <= now:
                self._arrive(arrivals[nxt], now)
                nxt += 1
                trigger = "arrival"
            while (t := self._peek_measure() if self._measure_heap else None) is not None and t <= now:
                _, _, job_id, _ = heapq.heappop(self._measure_heap)
                self._measure(self.jobs[job_id], now)
                if trigger == "tick":
                    trigger = "model_update"
            if t_event > now and trigger == "tick" and self._wakeup is not None and now >= self._wakeup:
                trigger = "wakeup"
            if self.active or trigger != "tick":
                self._decide(now, trigger)
            if self.active and self._used == 0 and nxt == n_total and not self._reconf_heap:
                idle_decisions += 1
                if idle_decisions > 3:
                    raise SimulationStalled(
                        f"at t={now:.0f}s {len(self.active)} jobs are active but the policy runs none "
                        f"(e.g. {next(iter(self.active))})"
                    )
            else:
                idle_decisions = 0
        self._flush_reconf(math.inf if limit is None else limit)
        if self.on_progress is not None:
            self.on_progress(completed, n_total, self.clock.now)
        return self._result()

    def _advance(self, to: float) -> None:
        self.gpu_s_used += self._used * (to - self._used_since)
        self._used_since = to
        self.clock.advance(to)

    def _peek_finish(self) -> float | None:
        heap = self._finish_heap
        while heap:
            t, _, job_id, version = heap[0]
            job = self.jobs[job_id]
            if job.version == version and job.finished_at is None:
                return t
            heapq.heappop(heap)
        return None

    def _flush_reconf(self, upto: float) -> None:
        heap = self._reconf_heap
        while heap and heap[0][0] <= upto:
            at, _, job_id, epoch, world, stop = heapq.heappop(heap)
            if self._pending_reconf.get(job_id) != epoch:
                continue
            del self._pending_reconf[job_id]
            job = self.jobs[job_id]
            if job.finished_at is not None:
                continue
            if at > self.clock.now:
                self._advance(at)
            self._emit(self._reconf_completed(job, epoch, world, stop), at=at)

    def _reconf_completed(
        self, job: _Job, epoch: int, world: int, stop: float
    ) -> ev.ReconfigurationCompleted:
        gpus = self.log.state.jobs[job.id].placement if self.placing else ()
        return ev.ReconfigurationCompleted(
            job_id=job.id, epoch=epoch, world_size=world, gpus=gpus, stop_time_s=stop, duration_s=stop
        )

    # -- arrivals and completions -------------------------------------------------

    def _arrive(self, tj: TraceJob, now: float) -> None:
        width = len(tj.throughput)
        by_type: dict[str, tuple[float, ...]] = {}
        if self.hetero and tj.throughput_by_type:
            lower = {k.lower(): v for k, v in tj.throughput_by_type.items()}
            for gpu_type in self.inventory:
                curve = tj.throughput_by_type.get(gpu_type) or lower.get(gpu_type.lower())
                if curve is not None:
                    by_type[gpu_type] = _fit(curve, width)
        job = _Job(tj, by_type)
        job.seq = self._arrived
        self._arrived += 1
        self.jobs[job.id] = job
        self.active[job.id] = job
        self._expire_view()
        self._views[job.id] = None
        key = (now, job.id)
        if self._last_arrival is not None and key < self._last_arrival:
            self._arrival_ordered = False
        self._last_arrival = key
        self._pend_add(job, now)
        self._emit(ev.JobSubmitted(job_id=job.id, spec=tj.spec))
        if self.config.profiling == "overestimate":
            self._measured[job.id] = {}
        else:
            self._publish_model(job, "", tj.throughput, overestimated=False)
            for gpu_type, curve in by_type.items():
                self._publish_model(job, gpu_type, curve, overestimated=False)

    def _publish_model(
        self,
        job: _Job,
        gpu_type: str,
        curve: tuple[float, ...],
        *,
        overestimated: bool,
        kind: str = "table",
        measured: tuple[int, ...] = (),
    ) -> None:
        """``ThroughputModelUpdated`` for one generation ("": the default curve), and the
        same curve in the caches the view reads (they always equal the folded models)."""
        if gpu_type:
            self.curves_by_type.setdefault(job.id, {})[gpu_type] = curve
        else:
            self.curves[job.id] = curve
        table = {k: v for k, v in enumerate(curve) if k > 0}
        samples = sum(len(m) for m in self._measured.get(job.id, {}).values())
        self._emit(
            ev.ThroughputModelUpdated(
                job_id=job.id,
                gpu_type=gpu_type,
                model_kind=kind,
                throughput=table,
                samples=samples,
                overestimated=overestimated,
                measured=measured,
            )
        )

    def _measure(self, job: _Job, now: float) -> None:
        """overestimate mode: the job ran ``measure_s`` on its current GPU count; publish
        what the profiler measured there (CoDDL §4.5), as the profiler would."""
        from shoal.profiling import OVERESTIMATE_KIND
        from shoal.profiling.overestimate import estimate_curve, is_overestimated

        if len(job.types) != 1:
            return  # a gang spread over generations gives no per-generation sample
        gpu_type = next(iter(job.types))
        curve = job.by_type.get(gpu_type, job.curve)
        max_gpus = len(job.curve) - 1
        measured = self._measured[job.id].setdefault(gpu_type, {})
        measured[job.gpus] = curve[job.gpus]
        estimate = _fit(estimate_curve(measured, max_gpus), len(job.curve))
        over = is_overestimated(measured, max_gpus)
        counts = tuple(sorted(measured))
        self.model_updates += 1
        types = (gpu_type, "") if self.hetero and gpu_type == self.default_type else (gpu_type,)
        for t in types if self.hetero else ("",):
            self._publish_model(job, t, estimate, overestimated=over, kind=OVERESTIMATE_KIND, measured=counts)

    def _peek_measure(self) -> float | None:
        heap = self._measure_heap
        while heap:
            t, _, job_id, version = heap[0]
            job = self.jobs[job_id]
            if job.version == version and job.finished_at is None:
                return t
            heapq.heappop(heap)
        return None

    def _complete(self, job: _Job, now: float) -> None:
        if job.gpus:
            self._run_remove(job)
        else:
            self._pend_remove(job)
        job.done = job.total
        job.finished_at = now
        self._used -= job.gpus
        job.gpus = 0
        job.types = {}
        job.rate = 0.0
        del self.active[job.id]
        self._expire_view()
        del self._views[job.id]
        self._left.append(job.id)
        self._pending_reconf.pop(job.id, None)
        self._emit(ev.JobCompleted(job_id=job.id, iterations=int(job.total)))

    # -- decisions ----------------------------------------------------------------

    def _decide(self, now: float, trigger: str) -> None:
        cfg = self.config
        state = self.log.state
        active = self.active
        view = self._view(now)
        if cfg.profiling == "overestimate":
            shares = decide_overestimate_first(
                self.policy,
                view,
                state.policy_memory,
                estimates=estimated_jobs(state, active),
                epoch=state.shares_epoch + 1,
                trigger=trigger,
                network_packing=cfg.network_packing and not cfg.flat,
            )
        else:
            shares = decide_shares(
                self.policy,
                view,
                state.policy_memory,
                epoch=state.shares_epoch + 1,
                trigger=trigger,
                network_packing=cfg.network_packing and not cfg.flat,
            )
        self.decisions += 1
        memory = shares.policy_memory
        wake = memory.get("next_decision_at_s")
        self._wakeup = float(math.ceil(wake - _EPS)) if isinstance(wake, int | float) else None

        # The shares in force (the running jobs' GPUs) and their GPU types; loops below
        # visit only the jobs whose share differs, in arrival order (the order every loop
        # used to take over all active jobs: events and heap entries come out the same).
        current = self._alloc
        running_jobs = self._running
        if self._typed:
            current_types = {j: state.jobs[j].gpu_type for j in current if state.jobs[j].gpu_type}
        else:
            current_types = {}
        unchanged = shares.shares == current and shares.gpu_types == current_types
        emitted = not unchanged or memory != state.policy_memory
        # The (job, GPUs) pairs in exactly one of the shares in force and the new ones
        # (empty when they are equal): most decisions change one or two jobs' shares.
        changed: set[tuple[str, int]] = set()
        if emitted and not unchanged:
            changed = current.items() ^ shares.shares.items()
            # Settle progress under the old rates before the fold sees new shares: the
            # running jobs whose (job, GPUs) pair is not among the new shares (the pairs
            # of `changed` that are the shares in force).
            differ = [running_jobs[j] for j, g in changed if current.get(j) == g]
            for job in sorted(differ, key=_seq):
                self._settle(job, now, report=True)
        if emitted:
            self._emit(shares)
            self._emit_trades(memory)
        epoch = state.shares_epoch

        moved: set[str] = set()
        disjoint: set[str] = set()
        added: dict[str, int] = {}
        placements: Mapping[str, tuple[ev.GpuRef, ...]] = {}
        if not self.placing:
            new_alloc = shares.shares
        elif unchanged and (not emitted or (self._placer_keeps_same and NODE_HINTS not in memory)):
            # No new SharesDecided: the placer service has nothing to place. With one
            # but the same shares, min-migration keeps every job where it is (all GPUs
            # can be kept), so asking it would return the current placement; not so
            # when the policy names nodes (a Gandiva_fair migration keeps the shares).
            if cfg.series:
                self._sample(now)
            return
        else:
            running = sorted(running_jobs.values(), key=_seq)
            previous = {job.id: state.jobs[job.id].placement for job in running}
            placed, result = place(self._topology, shares, previous, placer=cfg.placer)
            if result.unplaced:
                self.unplaced_decisions += 1
            placements = placed.placements
            new_alloc = {j: len(g) for j, g in placements.items()}
            if placements != previous:
                for j, gpus in placements.items():
                    old = previous.get(j)
                    if old is not None and old != gpus:
                        moved.add(j)
                        if old and gpus:
                            kept = set(old) & set(gpus)
                            added[j] = len(gpus) - len(kept)
                            if not kept:
                                disjoint.add(j)  # train/controller.py restarts it from a checkpoint
                        if len(old) == len(gpus):
                            self._settle(active[j], now, report=True)
                self.migrations += placed.migrations
                self._emit(placed)

        # Only a job whose GPU count differs or whose GPUs moved can change (a job given
        # 0 that holds none is classified as no change, as before). Without placement the
        # new GPU counts are the shares, and nothing above changed the counts in force:
        # `changed` already holds the pairs that differ.
        if self.placing:
            candidates = {j for j, _ in self._alloc.items() ^ new_alloc.items()}
        else:
            candidates = {j for j, _ in changed}
        candidates.update(moved)
        for job in sorted((active[j] for j in candidates), key=_seq):
            j = job.id
            new = new_alloc.get(j, 0)
            kind = classify(job.gpus, new, j in moved, j in disjoint)
            if kind is None:
                continue
            self._reconfigure(job, new, kind, now, epoch, placements.get(j, ()), added.get(j))

        if cfg.series:
            self._sample(now)

    def _view(self, now: float) -> ClusterView:
        """What :func:`shoal.view.build_view` returns for the active jobs, with each
        job's exact progress and published curves, built job by job with
        :func:`shoal.view.job_view`. A job that holds no GPUs keeps its view until an
        event about it is folded (:meth:`_emit` marks it stale then): in a long queue most
        jobs wait, and rebuilding their views was most of a decision's cost. For a
        policy that reads no progress (:func:`shoal.policies.base.policy_reads_progress`)
        a running job's view, too, stays as built at the newest event about it.
        ``tests/sim/test_engine.py`` checks the result equals ``build_view`` at every
        decision (but for those fields of those jobs, with such a policy)."""
        state = self.log.state
        jobs = state.jobs
        views = self._views
        curves = self.curves
        by_type_all = self.curves_by_type if self.hetero else None
        stale = self._stale
        active = self.active
        self._expire_view()
        # A running job about which nothing was folded since its view was built has
        # only moved in time (job_view_at), which a policy that reads no progress does
        # not see; the others are built afresh.
        moved: list[str] = []  # the jobs moved in time
        progress: list[tuple[str, float]] = []
        for job_id in state.shares if self._carry_progress else ():
            if job_id not in stale and views.get(job_id) is not None:
                moved.append(job_id)
                # _Job.progress(now), inlined (a call per running job per decision
                # was a measurable part of the view): the same arithmetic.
                job = active[job_id]
                rate = job.rate
                done = job.done
                if rate > 0.0:
                    start = job.settled_at if job.settled_at > job.resume_at else job.resume_at
                    if now > start:
                        # min(job.total, ...) as a comparison (the same value).
                        done += rate * (now - start)
                        total = job.total
                        if not done < total:
                            done = total
                progress.append((job_id, done))
        if progress:
            views_at(views, jobs, progress, now=now)  # type: ignore[arg-type]  # those entries are views
        rebuild = [j for j in stale if j in views]
        stale.clear()
        for job_id in rebuild:
            js = jobs[job_id]
            curve = curves.get(job_id)
            if curve is None:
                curve = job_curve(js)
            by_type = by_type_all.get(job_id) if by_type_all is not None else None
            views[job_id] = job_view(
                job_id,
                js,
                now=now,
                curve=curve,
                curves_by_type=by_type,
                iterations_done=active[job_id].progress(now),
            )
        # The view's jobs read _views itself (no copy of a long queue at each decision),
        # until the next change of _views expires them. Between two views, _views changes
        # only here (the jobs moved in time and those rebuilt), at an arrival (the job is
        # stale, so rebuilt here) and at a completion (the job leaves): those two lists
        # are the entries rebuilt since the previous view (LiveJobs.rebuilt_since); the
        # completions are the jobs that left (LiveJobs.left_since).
        if rebuild:
            moved += rebuild
        serial = next(_VIEW_SERIALS)
        left, self._left = self._left, []
        jobs_view = self._live_jobs = LiveJobs(
            views,  # type: ignore[arg-type]  # every entry was just built
            serial=serial,
            after=self._view_serial,
            rebuilt=moved,
            left=left,
        )
        self._view_serial = serial
        if self._cluster is None:
            self._cluster = (
                cluster_gpus(state)[1],
                {u: float(us.tickets) for u, us in state.users.items()},
            )
        by_gen, tickets = self._cluster
        view = ClusterView(
            now_s=now,
            total_gpus=self.total_gpus,
            jobs=jobs_view,
            gpus_by_type=dict(by_gen) if len(by_gen) > 1 else {},
            gpus_per_node=0 if self.config.flat else self.config.gpus_per_node,
            user_tickets=dict(tickets),
            arrival_ordered=self._arrival_ordered,
        )
        # The index is _views itself, not a copy (a copy of a long queue's index cost a
        # noticeable part of each decision): it does not change until the next decision.
        prime_jobs_by_id(view, views)  # type: ignore[arg-type]  # as above
        return view

    def _expire_view(self) -> None:
        """_views is about to change: the newest view's jobs may no longer be read."""
        live = self._live_jobs
        if live is not None:
            live.expire()
            self._live_jobs = None

    def _emit_trades(self, memory: Mapping[str, Any]) -> None:
        """Publish the trades a policy reports in its memory (Gandiva_fair §3.4)."""
        for trade in memory.get("trades_executed", ()) or ():
            self._emit(msgspec.convert(trade, ev.TradeExecuted))
        for undo in memory.get("trades_undone", ()) or ():
            self._emit(msgspec.convert(undo, ev.TradeUndone))

    def _settle(self, job: _Job, now: float, *, report: bool) -> None:
        job.done = job.progress(now)
        job.settled_at = now
        if report:
            self._emit(
                ev.ProgressReported(
                    job_id=job.id,
                    iteration=int(job.done),
                    num_gpus=job.gpus,
                    epoch=self.log.state.shares_epoch,
                    samples_per_s=0.0,
                )
            )

    def _rate(self, job: _Job, new: int, gpus: Sequence[ev.GpuRef]) -> tuple[float, dict[str, int]]:
        """Throughput of ``job`` on ``new`` GPUs (``gpus`` when placed) and GPUs per generation."""
        if not new:
            return 0.0, {}
        if not gpus:
            types = {self.default_type: new}
        else:
            types = {}
            node_type = self._node_type
            for g in gpus:
                t = node_type[g.node_id]
                types[t] = types.get(t, 0) + 1
        if not job.by_type:
            return job.curve[new], types
        # BSP: a gang over several generations runs at the slowest one's pace.
        return min(job.by_type.get(t, job.curve)[new] for t in types), types

    def _reconfigure(
        self,
        job: _Job,
        new: int,
        kind: str,
        now: float,
        epoch: int,
        gpus: Sequence[ev.GpuRef] = (),
        added: int | None = None,
    ) -> None:
        if job.settled_at != now:
            self._settle(job, now, report=False)
        old = job.gpus
        rate_old = job.rate if old else 0.0
        if job.id in self._pending_reconf and job.resume_at > now:
            # CoDDL §4.3: the newer order cancels the in-flight one; its stop ends now
            # and the new change's stop starts (lost GPU time counts only what elapsed).
            self.lost_gpu_s -= (job.resume_at - now) * old
        if old:
            self._run_remove(job)
        else:
            self._pend_remove(job)
        self._used += new - old
        job.gpus = new
        job.rate, job.types = self._rate(job, new, gpus)
        cost = charge(
            self.costs,
            kind,
            old,
            new,
            rate_old=rate_old,
            rate_new=job.rate,
            added=added,
            resumed=job.done > 0,
            gpus_per_node=0 if self.config.flat else self.config.gpus_per_node,
        )
        stop = cost.stop_s
        job.resume_at = now + stop if new else now
        job.version += 1
        if kind == "start":
            self.starts += 1
            if job.pending_since is not None:
                job.wait += now - job.pending_since
                job.pending_since = None
        elif kind == "stop":
            self.preemptions += 1
            job.pending_since = now
        else:
            self.reconfigurations += 1
            job.reconfigs += 1
        if new:
            self._run_add(job)
        else:
            self._pend_add(job, now)
        if new:
            self.lost_gpu_s += cost.lost_gpu_s
            remaining = job.total - job.done
            finish = job.resume_at + remaining / job.rate
            t = float(math.ceil(finish - _EPS))
            self._heap_seq += 1
            heapq.heappush(self._finish_heap, (max(t, now), self._heap_seq, job.id, job.version))
            if self.config.profiling == "overestimate" and len(job.types) == 1:
                seen = self._measured[job.id].get(next(iter(job.types)), {})
                if new not in seen:
                    at = float(math.ceil(job.resume_at + self.config.measure_s - _EPS))
                    self._heap_seq += 1
                    heapq.heappush(
                        self._measure_heap, (max(at, now + 1), self._heap_seq, job.id, job.version)
                    )
        if job.id in self._pending_reconf:
            prev = self._pending_reconf.pop(job.id)
            self._emit(
                ev.ReconfigurationCancelled(job_id=job.id, epoch=prev, by_epoch=epoch, reason="superseded")
            )
        if stop > 0:
            self._pending_reconf[job.id] = epoch
            self._heap_seq += 1
            heapq.heappush(self._reconf_heap, (now + stop, self._heap_seq, job.id, epoch, new, stop))
        else:
            self._emit(self._reconf_completed(job, epoch, new, 0.0))

    # -- metrics -----------------------------------------------------------------------

    def _pend_add(self, job: _Job, now: float) -> None:
        self._n_pending += 1
        remaining_1gpu = (job.total - job.done) / job.curve[1]
        if remaining_1gpu > 0:
            job.pend_inv = 1.0 / remaining_1gpu
            job.pend_c = (job.wait - now) * job.pend_inv
            self._bi_s1 += job.pend_c
            self._bi_s2 += job.pend_inv

    def _pend_remove(self, job: _Job) -> None:
        self._n_pending -= 1
        self._bi_s1 -= job.pend_c
        self._bi_s2 -= job.pend_inv
        job.pend_c = job.pend_inv = 0.0
        if not self._n_pending:
            self._bi_s1 = self._bi_s2 = 0.0  # no float residue once the queue is empty

    def _run_add(self, job: _Job) -> None:
        self._running[job.id] = job
        self._alloc[job.id] = job.gpus
        self._n_running += 1
        self._ce_sum += job.rate / job.curve[1]
        held = self._held
        for t, n in job.types.items():
            key = (job.user, t)
            held[key] = held.get(key, 0) + n

    def _run_remove(self, job: _Job) -> None:
        del self._running[job.id]
        del self._alloc[job.id]
        self._n_running -= 1
        self._ce_sum -= job.rate / job.curve[1]
        if not self._n_running:
            self._ce_sum = 0.0
        held = self._held
        for t, n in job.types.items():
            key = (job.user, t)
            left = held[key] - n
            if left:
                held[key] = left
            else:
                del held[key]

    def _sample(self, now: float) -> None:
        """Record QL, CE, BI (AFS §2.2) and the per-user shares in force from ``now``.

        Kept as running sums updated when a job arrives, starts, changes, stops or
        finishes, so a sample costs O(users × generations), not O(active jobs): CE's
        sum of ``rate / rate(1 GPU)`` over running jobs, and for the pending ones
        ``BI_sum(t) = Σ (wait_j + t − pending_since_j) / r_j = S1 + t · S2`` with
        ``r_j`` the remaining time on 1 GPU (constant while a job waits).
        :meth:`recompute_metrics` computes the same from scratch.
        """
        ql = self._n_pending
        self.series.add(
            now,
            ql,
            self._ce_sum / self.total_gpus,
            (self._bi_s1 + now * self._bi_s2) / ql if ql else 0.0,
            self._used,
            self._bi_s2 / ql if ql else 0.0,
        )
        self.user_shares.add(now, self._held)

    def recompute_metrics(self, now: float) -> tuple[int, float, float, float, dict[tuple[str, str], int]]:
        """QL, CE, BI, BI's slope and the per-user shares at ``now``, from every active job."""
        ql = 0
        ce = 0.0
        bi_sum = 0.0
        slope = 0.0
        held: dict[tuple[str, str], int] = {}
        for job in self.active.values():
            if job.gpus:
                # AFS §2.2: current throughput over the job's 1-GPU throughput (on a
                # heterogeneous cluster, 1 GPU of the default generation).
                ce += job.rate / job.curve[1]
                for t, n in job.types.items():
                    key = (job.user, t)
                    held[key] = held.get(key, 0) + n
            else:
                ql += 1
                pending = job.wait + (now - job.pending_since if job.pending_since is not None else 0.0)
                remaining_1gpu = (job.total - job.done) / job.curve[1]
                if remaining_1gpu > 0:
                    bi_sum += pending / remaining_1gpu
                    slope += 1.0 / remaining_1gpu
        return (
            ql,
            ce / self.total_gpus,
            bi_sum / ql if ql else 0.0,
            slope / ql if ql else 0.0,
            held,
        )

    # -- results ----------------------------------------------------------------------

    def _result(self) -> SimResult:
        outcomes = []
        jcts = []
        for tj in self.trace_jobs:
            job = self.jobs.get(tj.job_id)
            if job is None:
                continue
            jct = None if job.finished_at is None else job.finished_at - job.arrival
            if jct is not None:
                jcts.append(jct)
            outcomes.append(
                JobOutcome(
                    job_id=job.id,
                    model=job.model,
                    requested_gpus=job.requested,
                    arrival_s=job.arrival,
                    completion_s=job.finished_at,
                    jct_s=jct,
                    duration_s=job.duration,
                    wait_s=job.wait,
                    reconfigurations=job.reconfigs,
                    user=job.user,
                )
            )
        first = min((o.arrival_s for o in outcomes), default=0.0)
        last = max((o.completion_s for o in outcomes if o.completion_s is not None), default=first)
        makespan = last - first
        summary: dict[str, float] = {
            "jobs": float(len(self.trace_jobs)),
            "completed": float(len(jcts)),
            **jct_summary(jcts),
            "makespan_s": makespan,
            "reconfigurations": float(self.reconfigurations),
            "starts": float(self.starts),
            "preemptions": float(self.preemptions),
            "migrations": float(self.migrations),
            "lost_gpu_s": self.lost_gpu_s,
            "gpu_s_used": self.gpu_s_used,
            "gpu_utilisation": self.gpu_s_used / (self.total_gpus * makespan) if makespan > 0 else 0.0,
            "decisions": float(self.decisions),
            "unplaced_decisions": float(self.unplaced_decisions),
            "model_updates": float(self.model_updates),
            "events": float(len(self.log)),
        }
        if self.config.series and makespan > 0:
            for name in ("ql", "ce", "bi"):
                summary[f"avg_{name}"] = self.series.time_average(name, first, last)
        self.user_shares.pad()
        return SimResult(
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            trace=self.trace,
            config=self.config,
            summary=summary,
            jobs=outcomes,
            series=self.series,
            event_counts=dict(self.log.counts),
            final_digest=digest(self.log.state),
            user_shares=self.user_shares if self.config.series else None,
        )


def simulate(
    jobs: Sequence[TraceJob],
    policy: Policy,
    config: SimConfig | None = None,
    *,
    trace: str = "",
    on_progress: Callable[[int, int, float], None] | None = None,
) -> SimResult:
    """Run one simulation (see :class:`Simulator`)."""
    return Simulator(jobs, policy, config, trace=trace, on_progress=on_progress).run()


def make_policy(name: str, params: Mapping[str, Any] | None = None, *, seed: int = 0) -> Policy:
    """A policy from the registry (imported lazily), given ``seed`` when it takes one."""
    from shoal.policies.registry import get_policy

    kwargs = dict(params or {})
    try:
        return get_policy(name, seed=seed, **kwargs)
    except TypeError:
        return get_policy(name, **kwargs)

"""Discrete-event simulation of a shared GPU cluster in virtual time.

The simulator drives the same code the services run: every state change is an event
appended to an :class:`~shoal.sim.log.InMemoryLog` and folded by
:func:`shoal.state.apply`; decisions come from :func:`shoal.view.build_view` and
:mod:`shoal.allocation`. Only the passage of time and the jobs' progress are modelled
here, in place of the trainer sidecars.

Event sequence (REPRODUCTION.md, "AFS / CoDDL"):

* Nodes are registered at t = 0 (``NodeRegistered``): one node of ``total_gpus`` in
  the flat pool (``flat=True``; no network packing, no placement), else
  ``total_gpus / gpus_per_node`` servers.
* Arrival: ``JobSubmitted`` and the job's curve as a ``ThroughputModelUpdated``
  (``model_kind="table"``). Arrivals are whole seconds (rounded up by the loader).
* Decision at every arrival, completion and policy tick, after all events of that
  virtual second (coalesced): ``ProgressReported`` for each running job whose GPUs
  change (settles its continuous progress), ``SharesDecided`` (skipped when shares and
  memory are unchanged), ``PlacementDecided`` (topology mode, when it changed), and one
  ``ReconfigurationCompleted`` per changed job, at ``now + stop_time`` with the cost
  model's stop time (a newer change before that cancels it: ``ReconfigurationCancelled``).
* Completion: at ``ceil(exact finish time)`` (whole seconds, a 1 µs tolerance absorbs
  float error), ``JobCompleted``.
* Progress is continuous: ``rate = curve[gpus]`` iterations/s from
  ``max(change time, end of the stop)`` on.

Policy ticks (lease/quantum timeouts): the policy's ``tick_s`` attribute (or
``lease_s``/``quantum_s``), overridable by ``SimConfig.tick_s``, re-runs the policy on the
grid ``k·tick_s`` while jobs are active; in addition a decision whose memory holds
``next_decision_at_s`` asks for a re-run then (rounded up to a whole second).

Open points, chosen: a job with a positive share the placer could not place runs on
nothing at that epoch (counted in ``unplaced_decisions``); when jobs are active but no
job runs and no future event exists, the run stops with :class:`SimulationStalled`
rather than loop forever.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from msgspec import Struct

from shoal import events as ev
from shoal.allocation import decide_shares, place
from shoal.events import GpuInfo
from shoal.policies.base import Policy
from shoal.sim.costs import PRESETS, ReconfigCosts, classify
from shoal.sim.log import InMemoryLog, VirtualClock
from shoal.sim.metrics import Series, jct_summary
from shoal.view import build_view
from shoal.workloads import TraceJob

_EPS = 1e-6


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
    """``None``: ``free`` when flat, ``coddl`` on a topology."""
    tick_s: float | None = None
    """Policy re-run period; ``None``: the policy's own ``tick_s``/``lease_s``/``quantum_s``."""
    retain_log: bool = True
    max_time_s: float | None = None
    """Stop at this virtual time (unfinished jobs are reported, not counted in JCT)."""
    series: bool = True


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


class _Job:
    """The simulator's mutable record of one job (progress lives here, not in the state)."""

    __slots__ = (
        "arrival",
        "curve",
        "done",
        "duration",
        "finished_at",
        "gpus",
        "id",
        "model",
        "pending_since",
        "rate",
        "reconfigs",
        "requested",
        "resume_at",
        "settled_at",
        "total",
        "version",
        "wait",
    )

    def __init__(self, tj: TraceJob) -> None:
        self.id = tj.job_id
        self.arrival = tj.submit_time_s
        self.curve = tj.throughput
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
        self.finished_at: float | None = None
        self.reconfigs = 0

    def progress(self, now: float) -> float:
        if self.rate <= 0.0:
            return self.done
        start = self.settled_at if self.settled_at > self.resume_at else self.resume_at
        if now <= start:
            return self.done
        return min(self.total, self.done + self.rate * (now - start))


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
        if cfg.total_gpus <= 0:
            raise ValueError("total_gpus must be positive")
        if not cfg.flat and (cfg.gpus_per_node <= 0 or cfg.total_gpus % cfg.gpus_per_node):
            raise ValueError(f"{cfg.total_gpus} GPUs do not split into nodes of {cfg.gpus_per_node}")
        self.policy = policy
        self.trace = trace
        self.on_progress = on_progress
        self.costs = cfg.costs or (PRESETS["free"] if cfg.flat else PRESETS["coddl"])
        self.tick = cfg.tick_s if cfg.tick_s is not None else policy_tick(policy)
        self.trace_jobs = sorted(jobs, key=lambda j: j.submit_time_s)
        ids = [j.job_id for j in self.trace_jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate job ids in workload")
        self.clock = VirtualClock(0.0)
        self.log = InMemoryLog(retain=cfg.retain_log)
        self.jobs: dict[str, _Job] = {}
        self.active: dict[str, _Job] = {}
        """Active jobs in arrival order (dicts keep insertion order)."""
        self.curves: dict[str, tuple[float, ...]] = {}
        self.series = Series()
        self._finish_heap: list[tuple[float, int, str, int]] = []
        self._reconf_heap: list[tuple[float, int, str, int, int, float]] = []
        self._pending_reconf: dict[str, int] = {}
        self._heap_seq = 0
        self._wakeup: float | None = None
        self._topology: Any = None
        self.reconfigurations = 0
        self.starts = 0
        self.preemptions = 0
        self.lost_gpu_s = 0.0
        self.gpu_s_used = 0.0
        self.unplaced_decisions = 0
        self.migrations = 0
        self.decisions = 0
        self._used = 0
        self._used_since = 0.0

    # -- emission --------------------------------------------------------------

    def _emit(self, event: ev.Event, at: float | None = None) -> None:
        self.log.append(event, self.clock.now if at is None else at)

    # -- setup -----------------------------------------------------------------

    def _register_nodes(self) -> None:
        cfg = self.config
        if cfg.flat:
            nodes = [("pool", cfg.total_gpus)]
        else:
            from shoal.placement import Topology

            n = cfg.total_gpus // cfg.gpus_per_node
            self._topology = Topology.homogeneous(n, cfg.gpus_per_node, gpu_type=cfg.gpu_type)
            nodes = [(node.node_id, len(node.gpu_indices)) for node in self._topology.nodes]
        for node_id, count in nodes:
            gpus = tuple(GpuInfo(index=i, gpu_type=cfg.gpu_type) for i in range(count))
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
        gpus = self.log.state.jobs[job.id].placement if not self.config.flat else ()
        return ev.ReconfigurationCompleted(
            job_id=job.id, epoch=epoch, world_size=world, gpus=gpus, stop_time_s=stop, duration_s=stop
        )

    # -- arrivals and completions -------------------------------------------------

    def _arrive(self, tj: TraceJob, now: float) -> None:
        job = _Job(tj)
        self.jobs[job.id] = job
        self.active[job.id] = job
        self.curves[job.id] = tj.throughput
        self._emit(ev.JobSubmitted(job_id=job.id, spec=tj.spec))
        table = {k: v for k, v in enumerate(tj.throughput) if k > 0}
        self._emit(
            ev.ThroughputModelUpdated(job_id=job.id, gpu_type="", model_kind="table", throughput=table)
        )
        for gpu_type, curve in sorted(tj.throughput_by_type.items()):
            table = {k: v for k, v in enumerate(curve) if k > 0}
            self._emit(
                ev.ThroughputModelUpdated(
                    job_id=job.id, gpu_type=gpu_type, model_kind="table", throughput=table
                )
            )

    def _complete(self, job: _Job, now: float) -> None:
        job.done = job.total
        job.finished_at = now
        self._used -= job.gpus
        job.gpus = 0
        job.rate = 0.0
        del self.active[job.id]
        self._pending_reconf.pop(job.id, None)
        self._emit(ev.JobCompleted(job_id=job.id, iterations=int(job.total)))

    # -- decisions ----------------------------------------------------------------

    def _decide(self, now: float, trigger: str) -> None:
        cfg = self.config
        state = self.log.state
        active = self.active
        progress = {j: job.progress(now) for j, job in active.items()}
        view = build_view(
            state,
            now=now,
            gpus_per_node=0 if cfg.flat else cfg.gpus_per_node,
            total_gpus=cfg.total_gpus,
            curves=self.curves,
            progress=progress,
            job_ids=active.keys(),
        )
        shares = decide_shares(
            self.policy,
            view,
            state.policy_memory,
            epoch=state.shares_epoch + 1,
            trigger=trigger,
            network_packing=cfg.network_packing and not cfg.flat,
        )
        self.decisions += 1
        wake = shares.policy_memory.get("next_decision_at_s")
        self._wakeup = float(math.ceil(wake - _EPS)) if isinstance(wake, int | float) else None

        current = {j: job.gpus for j, job in active.items() if job.gpus}
        current_types = {j: state.jobs[j].gpu_type for j in current if state.jobs[j].gpu_type}
        if (
            shares.shares != current
            or shares.gpu_types != current_types
            or shares.policy_memory != state.policy_memory
        ):
            # Settle progress under the old rates before the fold sees new shares.
            for j, job in active.items():
                if job.gpus and shares.shares.get(j, 0) != job.gpus:
                    self._settle(job, now, report=True)
            self._emit(shares)
        epoch = state.shares_epoch

        moved: set[str] = set()
        if cfg.flat:
            new_alloc = shares.shares
        else:
            previous = {j: state.jobs[j].placement for j, job in active.items() if job.gpus}
            placed, result = place(self._topology, shares, previous, placer=cfg.placer)
            if result.unplaced:
                self.unplaced_decisions += 1
            new_alloc = {j: len(g) for j, g in placed.placements.items()}
            changed_placement = placed.placements != previous
            if changed_placement:
                for j, gpus in placed.placements.items():
                    old = previous.get(j)
                    if old is not None and old != gpus:
                        moved.add(j)
                        if len(old) == len(gpus):
                            self._settle(active[j], now, report=True)
                self.migrations += placed.migrations
                self._emit(placed)

        for j, job in active.items():
            new = new_alloc.get(j, 0)
            kind = classify(job.gpus, new, j in moved)
            if kind is None:
                continue
            self._reconfigure(job, new, kind, now, epoch)

        if cfg.series:
            self._sample(now)

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

    def _reconfigure(self, job: _Job, new: int, kind: str, now: float, epoch: int) -> None:
        if job.settled_at != now:
            self._settle(job, now, report=False)
        stop = self.costs.stop_time(kind)
        old = job.gpus
        self._used += new - old
        job.gpus = new
        job.rate = job.curve[new] if new else 0.0
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
            self.lost_gpu_s += stop * new
            remaining = job.total - job.done
            finish = job.resume_at + remaining / job.rate
            t = float(math.ceil(finish - _EPS))
            self._heap_seq += 1
            heapq.heappush(self._finish_heap, (max(t, now), self._heap_seq, job.id, job.version))
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

    def _sample(self, now: float) -> None:
        m = self.config.total_gpus
        ql = 0
        ce = 0.0
        bi_sum = 0.0
        for job in self.active.values():
            curve = job.curve
            if job.gpus:
                ce += curve[job.gpus] / curve[1]
            else:
                ql += 1
                pending = job.wait + (now - job.pending_since if job.pending_since is not None else 0.0)
                remaining_1gpu = (job.total - job.done) / curve[1]
                if remaining_1gpu > 0:
                    bi_sum += pending / remaining_1gpu
        self.series.add(now, ql, ce / m, bi_sum / ql if ql else 0.0, self._used)

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
            "gpu_utilisation": self.gpu_s_used / (self.config.total_gpus * makespan) if makespan > 0 else 0.0,
            "decisions": float(self.decisions),
            "unplaced_decisions": float(self.unplaced_decisions),
            "events": float(len(self.log)),
        }
        if self.config.series and makespan > 0:
            for name in ("ql", "ce", "bi"):
                summary[f"avg_{name}"] = self.series.time_average(name, first, last)
        return SimResult(
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            trace=self.trace,
            config=self.config,
            summary=summary,
            jobs=outcomes,
            series=self.series,
            event_counts=dict(self.log.counts),
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
